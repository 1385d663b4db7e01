"""Candidate actions compared by the SLO attainment they are projected to leave, as a pure core.

Owns the choice among doing nothing, the flip the role hysteresis allows (`policy._fluid_role`)
and moving running decodes off the most loaded decode worker (`Migration`, "balance"): each is
scored with `projection.attainment` on the decode workers' projected batches and the prefill
queue as the action would leave them, and the best is taken. The flip the hysteresis allowed
wins a tie (the measured pressure asked for it; a model that sees no difference must not hold
it), unless it is contested (it takes a worker from a role that is not calm): then it must
leave strictly more requests in time than doing nothing. A migration wins a tie with doing
nothing only when it cuts the worst projected step by at least BALANCE_GAIN (attainment
counts a worker in time or not: a move that shortens every late step by half changes no
count). A flip that would leave fewer requests in time
than doing nothing is held: the pressure that asked for it would be paid for by the other role.
With migration on, a new decode worker is counted with the running decodes evened out over the
decode workers (the balance moves that follow it).

Must not do I/O, read a clock, draw random numbers or import torch, grpc or a service (the
policy's rule, which it serves); never orders a flip the policy did not allow.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from pdserve.controller.inputs import ControllerInput, Flip, Migration, PolicyConfig, WorkerView
from pdserve.controller.projection import StepModel, arriving, attainment, project
from pdserve.core.roles import DECODE, PREFILL, SERVING



# A migration that leaves attainment as it is must cut the worst projected step by this share.
BALANCE_GAIN = 0.1


@dataclass(frozen=True)
class Scene:
    """What an action changes: the decode workers' batches and KV, the requests prefilling now
    (they join the decode workers), the prefill workers serving; and what none changes, the
    admitted decode work a second (shared by however many decode workers there are)."""

    batches: tuple[int, ...]
    kv_blocks: tuple[float, ...]
    incoming: int
    prefill_workers: int
    tokens_per_s: float = 0.0
    # Running decodes of a decode worker flipped away: they join the others as incoming
    # requests do, but wait for no prefill.
    moved: int = 0

    def score(self, inp: ControllerInput, model: StepModel, prefill_now: int
              ) -> tuple[float, float]:
        """(projected attainment, worst projected step)."""
        p = inp.prefill
        # The queue clears at the pool's rate, which scales with its workers.
        queue_s = (p.work_s * prefill_now / self.prefill_workers if self.prefill_workers
                   else float("inf"))
        budget = inp.slo.queue_budget_s
        proj = project(self.batches, self.kv_blocks,
                       arriving(self.incoming, queue_s, budget) + self.moved, model,
                       self.tokens_per_s)
        return (attainment(proj.batches, proj.steps_s, inp.slo.itl_s, self.incoming, queue_s,
                           budget), proj.worst_step_s)


def _decoders(inp: ControllerInput, leaving: set[str]) -> list[WorkerView]:
    return [w for w in inp.workers if w.role == DECODE and w.state == SERVING
            and w.to_role is None and w.address not in leaving]


def scene_now(inp: ControllerInput) -> tuple[Scene, list[WorkerView]]:
    dec = _decoders(inp, set())
    pre = [w for w in inp.workers if w.role == PREFILL and w.state == SERVING]
    return Scene(tuple(w.running + w.waiting for w in dec), tuple(float(w.kv_used_blocks)
                                                                  for w in dec),
                 sum(w.in_flight for w in pre), len(pre), inp.decode_tokens_per_s), dec


def _evened(scene: Scene) -> Scene:
    total, n = sum(scene.batches), len(scene.batches)
    kv_total = sum(scene.kv_blocks)
    batches = tuple(total // n + (1 if i < total % n else 0) for i in range(n))
    return replace(scene, batches=batches,
                   kv_blocks=tuple(kv_total * b / total if total else 0.0 for b in batches))


def _after_flips(scene: Scene, names: Sequence[str], flips: Sequence[Flip]) -> Scene:
    """`scene` once `flips` landed; `names`: the decode workers of `scene.batches`, in order."""
    names = list(names)
    for f in flips:
        if f.to_role == DECODE:  # a fresh decode worker: empty, takes its share of what comes
            names.append(f.address)
            scene = replace(scene, batches=scene.batches + (0,),
                            kv_blocks=scene.kv_blocks + (0.0,),
                            prefill_workers=scene.prefill_workers - 1)
        elif f.address in names:
            # A decode worker leaves: its running decodes move to the others.
            i = names.index(f.address)
            names.pop(i)
            scene = replace(scene, batches=scene.batches[:i] + scene.batches[i + 1:],
                            kv_blocks=scene.kv_blocks[:i] + scene.kv_blocks[i + 1:],
                            moved=scene.moved + scene.batches[i],
                            prefill_workers=scene.prefill_workers + 1)
    return scene


def _balance(scene: Scene, dec: Sequence[WorkerView], model: StepModel, inp: ControllerInput,
             cfg: PolicyConfig) -> tuple[Scene, Migration] | None:
    """The move that evens the most and least loaded decode workers out, when the most loaded
    one's projected step threatens the ITL SLO (above balance_share of it)."""
    if len(dec) < 2:
        return None
    proj = project(scene.batches, scene.kv_blocks, scene.incoming, model, scene.tokens_per_s)
    hi = max(range(len(dec)), key=lambda i: (proj.steps_s[i], dec[i].address))
    lo = min(range(len(dec)), key=lambda i: (proj.steps_s[i], dec[i].address))
    if proj.steps_s[hi] <= cfg.balance_share * inp.slo.itl_s:
        return None
    # Only the running decodes move (the waiting ones are admitted where they are).
    k = min(cfg.max_migrations_per_tick, dec[hi].running,
            (scene.batches[hi] - scene.batches[lo]) // 2)
    if k < 1:
        return None
    batches, kv = list(scene.batches), list(scene.kv_blocks)
    per_seq = kv[hi] / batches[hi] if batches[hi] else 0.0
    batches[hi] -= k
    batches[lo] += k
    kv[hi] -= per_seq * k
    kv[lo] += per_seq * k
    why = (f"{dec[hi].address} projected step {proj.steps_s[hi]:.3f} s > "
           f"{cfg.balance_share:g} x ITL {inp.slo.itl_s:g} s, {dec[lo].address} "
           f"{proj.steps_s[lo]:.3f} s")
    return (replace(scene, batches=tuple(batches), kv_blocks=tuple(kv)),
            Migration(dec[hi].address, k, why))


def choose(inp: ControllerInput, cfg: PolicyConfig, flips: tuple[Flip, ...],
           contested: bool = False) -> tuple[tuple[Flip, ...], tuple[Migration, ...], str]:
    """The flips to order (those given, or none) and the migrations, with a note of the
    scores; with no step model, the flips as given and no migration. `contested` flips lose
    every tie."""
    model = inp.step_model
    if model is None:
        return flips, (), ""
    scene, dec = scene_now(inp)
    prefill_now = scene.prefill_workers
    # (score, rank on a tie, label, flips, migrations)
    now_score, now_worst = scene.score(inp, model, prefill_now)
    options: list[tuple[float, float, str, tuple, tuple]] = [
        (now_score, 1, "nothing", (), ())]
    if cfg.balance:
        moved = _balance(scene, dec, model, inp, cfg)
        if moved is not None:
            score, worst = moved[0].score(inp, model, prefill_now)
            rank = 1.5 if worst <= (1 - BALANCE_GAIN) * now_worst else 0
            options.append((score, rank, f"move {moved[1].count} off {moved[1].address} "
                            f"(worst step {worst:.3f} s)", (), (moved[1],)))
    if flips:
        after = _after_flips(scene, [w.address for w in dec], flips)
        if cfg.balance and any(f.to_role == DECODE for f in flips) and after.batches:
            after = _evened(after)
        options.append((after.score(inp, model, prefill_now)[0], 0 if contested else 2,
                        f"flip {', '.join(f.address for f in flips)}", flips, ()))
    if len(options) == 1:
        return (), (), ""
    best = max(options, key=lambda o: (round(o[0], 6), o[1]))
    note = (f"projected attainment: nothing {now_score:.2f} (worst step {now_worst:.3f} s), "
            + ", ".join(f"{o[2]} {o[0]:.2f}" for o in options[1:]) + f"; {best[2]}")
    return best[3], best[4], note
