"""The controller's decision as a pure core: a `ControllerInput` and `now` in, a `Decision` out.

Owns when workers flip roles and how much prefill work each decode worker may take on, after
the FluidPD paper's two time scales:
- FluidRole (per tick): a role under sustained pressure takes a whole worker from the other
  role, with hysteresis (two thresholds, a sustain time, a per-worker cooldown, a floor per
  role) so the pools do not oscillate.
- FluidToken (per request): while the prefill role is pressured, each decode worker with slack
  gets an `OffloadBudget`: prefill chunks small enough that a decode step carrying one stays
  inside a share of the ITL SLO.
- An operator target (a manual prefill:decode split) is the source of truth: with one standing,
  pressure moves no worker; the policy steers toward the target and reports where pressure
  disagrees (`Decision.conflicts`) instead of undoing it.
- Ahead of time (with a step model in the input): decode pressure counts each decode worker's
  projected step once the requests prefilling now reach it (`projection.py`, through the
  view), and the flip the hysteresis allows is weighed against doing nothing and against
  moving running decodes off the most loaded decode worker, by projected SLO attainment
  (`actions.choose`). A prefill role that is not calm (between `low` and `high`, or pressured
  too, as a queue still draining when answers start to pile up) no longer holds a flip toward
  decode by itself: it is ordered only where the projection finds more requests in time.
`plan_rebalance` gives the flips that reach a split outright (the `pdserve ctl` path).

Must not do I/O, read a clock, draw random numbers or import torch, grpc or a service: the
controller service and the simulator feed it the same inputs and get the same decision. It
never adds or removes workers, only names flips; the actuators drain and switch.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

from pdserve.controller.actions import choose
# The policy's vocabulary, re-exported: its callers name records, roles and states through it.
from pdserve.controller.inputs import (STATES, ControllerInput, Decision, Flip,  # noqa: F401
                                       Migration, OffloadBudget, PolicyConfig, PolicyState,
                                       WorkerView)
from pdserve.controller.signals import Slo
from pdserve.core.roles import (DECODE, DRAINING, FAILED, GONE, PREFILL, ROLES,  # noqa: F401
                                SERVING, SWITCHING)


def _other(role: str) -> str:
    return DECODE if role == PREFILL else PREFILL


def _counted_role(w: WorkerView) -> str:
    # A SWITCHING worker still reports the role it is leaving; with two roles it is bound for
    # the other one. Counting it there keeps a flip in progress from being ordered twice.
    if w.to_role is not None:
        return w.to_role
    return _other(w.role) if w.state == SWITCHING else w.role


def _movable(w: WorkerView) -> bool:
    return w.state == SERVING and not w.pinned and w.to_role is None


def _load_key(w: WorkerView) -> tuple:
    # The least loaded worker gives up its role first: it has the least work to drain.
    if w.role == DECODE:
        return (w.running + w.waiting, w.kv_used_blocks, w.address)
    return (w.queued_prompt_tokens, w.address)


def _ratio(inp: ControllerInput, role: str) -> float:
    return inp.prefill.ratio if role == PREFILL else inp.decode.ratio


def _gap(live: Sequence[WorkerView], prefill: int):
    """(prefill workers now, role to flip toward or None, flips needed, movable givers least
    loaded first, pinned givers, givers not serving as "address (state)")."""
    have = sum(1 for w in live if _counted_role(w) == PREFILL)
    if prefill == have:
        return have, None, 0, [], [], []
    to_role = PREFILL if prefill > have else DECODE
    givers = [w for w in live if _counted_role(w) == _other(to_role)]
    return (have, to_role, abs(prefill - have),
            sorted((w for w in givers if _movable(w)), key=_load_key),
            sorted(w.address for w in givers if w.pinned),
            sorted(f"{w.address} ({w.state})" for w in givers
                   if not w.pinned and w.state != SERVING))


def _attribute_ttft(inp: ControllerInput, cfg: PolicyConfig) -> tuple[ControllerInput, str]:
    """The input with the prefill ratio the policy acts on, and a note when it differs.

    The prefill ratio is the worse of its queue term and its TTFT term, and a request's TTFT
    also holds its wait for a decode slot. When decode is pressured and the prefill queue is
    not, a high TTFT is the decode role's doing: counted for prefill it would read as "both
    roles pressured" and hold the very flip toward decode that would lower it. The prefill
    ratio is then its queue term alone."""
    p = inp.prefill
    if not (inp.decode.ratio > cfg.high and p.ratio > cfg.high
            and p.queue_ratio <= cfg.high and p.ttft_ratio >= p.ratio):
        return inp, ""
    note = (f"prefill TTFT term {p.ttft_ratio:.2f} set aside (decode {inp.decode.ratio:.2f} "
            f"is pressured, the prefill queue {p.queue_ratio:.2f} is not)")
    return replace(inp, prefill=replace(p, ratio=p.queue_ratio)), note


def decide(inp: ControllerInput, now: float, cfg: PolicyConfig = PolicyConfig()) -> Decision:
    inp, attributed = _attribute_ttft(inp, cfg)
    # While a flip is in flight its effect is not in the pressures yet: pressure seen now must
    # not count toward the next flip (in pressure mode; a target steers regardless).
    in_flight = tuple(sorted((w for w in inp.workers if w.state != GONE
                             and (w.state == SWITCHING or w.to_role is not None)),
                            key=lambda w: w.address))
    settling = bool(in_flight) and inp.target is None
    since = {role: None if _ratio(inp, role) <= cfg.high else now if prev is None or settling
             else prev for role, prev in ((PREFILL, inp.state.prefill_high_since_s),
                                          (DECODE, inp.state.decode_high_since_s))}
    state = PolicyState(since[PREFILL], since[DECODE])
    conflicts: tuple[str, ...] = ()
    migrations: tuple[Migration, ...] = ()
    if inp.target is not None:
        flips, role_reason, conflicts = _toward_target(inp, state, now, cfg, in_flight)
    else:
        if cfg.fluid_role:
            before = state
            flips, role_reason, state, contested = _fluid_role(inp, state, now, cfg,
                                                               in_flight)
        else:
            flips, role_reason = (), f"roles fixed (fluid_role off): {_pressures(inp)}"
            contested = False
        if not in_flight:
            chosen, migrations, scores = choose(inp, cfg, flips, contested)
            if flips and not chosen:  # held: the sustained pressure still counts next tick
                state, role_reason = before, f"hold instead of {role_reason}"
            flips = chosen
            role_reason = "; ".join(r for r in (role_reason, scores) if r)
    leaving = {f.address for f in flips}  # a worker flipped away this tick takes no budget
    budgets, token_reason = _fluid_token(inp, cfg, leaving) if cfg.fluid_token else ((), "")
    action = ("target" if inp.target is not None and flips else
              "+".join(a for a, on in (("flip", flips), ("migrate", migrations),
                                       ("offload", budgets)) if on) or "hold")
    reason = "; ".join(r for r in (role_reason, token_reason, attributed) if r)
    return Decision(state, flips, budgets, action, reason, conflicts, migrations)


def _pressures(inp: ControllerInput) -> str:
    return f"prefill {inp.prefill.ratio:.2f}, decode {inp.decode.ratio:.2f}"


def _fluid_role(inp: ControllerInput, state: PolicyState, now: float, cfg: PolicyConfig,
                in_flight: tuple[WorkerView, ...]
                ) -> tuple[tuple[Flip, ...], str, PolicyState, bool]:
    """(flips, reason, state, contested): a contested flip takes a prefill worker for decode
    while the prefill role is not calm, and is ordered only where the projection finds it
    strictly better. Decode alone gets them: the answers being admitted are what the
    projection sees ahead; a decode role between the marks gives no worker to prefill (taken
    on the projection's word, its decodes came back within seconds in `bench fluid`)."""
    p, d = inp.prefill.ratio, inp.decode.ratio
    projected = inp.step_model is not None
    if p > cfg.high and d > cfg.high and not projected:
        return (), (f"hold: both roles pressured ({_pressures(inp)} > {cfg.high:g}), "
                    "no role to take a worker from"), state, False
    if p <= cfg.high and d <= cfg.high:
        return (), f"hold: {_pressures(inp)}, neither above {cfg.high:g}", state, False
    # Both pressured (with a projection): decode may take a worker, where it says so.
    to_role = DECODE if d > cfg.high else PREFILL
    giver = _other(to_role)
    ratio, giver_ratio = _ratio(inp, to_role), _ratio(inp, giver)
    head = f"{to_role} {ratio:.2f} > {cfg.high:g}"
    if in_flight:
        moving = ", ".join(f"{w.address} to {_counted_role(w)}" for w in in_flight)
        return (), f"hold: {head}, but a flip is still in flight ({moving})", state, False
    since = state.prefill_high_since_s if to_role == PREFILL else state.decode_high_since_s
    held_s = now - since if since is not None else 0.0
    if held_s < cfg.sustain_s:
        return (), (f"hold: {head} for {held_s:.1f} s of {cfg.sustain_s:g} s sustain"
                    ), state, False
    head = f"{head} for {held_s:.1f} s"
    # Not calm (pressured too, or between the marks): only the projection may find a flip
    # toward decode worth it (`actions.choose`).
    contested = giver_ratio >= cfg.low
    if contested and (not projected or to_role == PREFILL):
        return (), (f"hold: {head}, but {giver} {giver_ratio:.2f} is not below {cfg.low:g}"
                    ), state, False
    serving = [w for w in inp.workers if w.role == giver and w.state == SERVING]
    movable = sorted((w for w in serving if _movable(w)), key=_load_key)
    cooled = [w for w in movable
              if w.last_flip_s is None or now - w.last_flip_s >= cfg.cooldown_s]
    n = max(0, min(cfg.max_flips_per_tick, len(serving) - cfg.min_per_role, len(cooled)))
    if n == 0:
        cooling = [f"{w.address} {cfg.cooldown_s - (now - w.last_flip_s):.1f} s"
                   for w in movable if w not in cooled]
        pinned = sorted(w.address for w in serving if w.pinned)
        why = (f"{len(serving)} serving, min_per_role {cfg.min_per_role}, "
               f"pinned {', '.join(pinned) or 'none'}, cooling {', '.join(cooling) or 'none'}")
        return (), f"hold: {head}, but no {giver} worker can move ({why})", state, False
    why = (f"{head}, {giver} {giver_ratio:.2f} not below {cfg.low:g}, the projection decides"
           if contested else f"{head}, {giver} {giver_ratio:.2f} < {cfg.low:g}")
    flips = tuple(Flip(w.address, giver, to_role, why) for w in cooled[:n])
    # The new worker gets a full sustain_s to show in the pressure before another follows.
    state = replace(state, **{f"{to_role}_high_since_s": now})
    return (flips, f"flip {', '.join(f.address for f in flips)} {giver}->{to_role}: {why}",
            state, contested)


def _toward_target(inp: ControllerInput, state: PolicyState, now: float, cfg: PolicyConfig,
                   in_flight: tuple[WorkerView, ...]
                   ) -> tuple[tuple[Flip, ...], str, tuple[str, ...]]:
    want = dict(zip(ROLES, inp.target))  # type: ignore[arg-type]
    label = f"operator target {want[PREFILL]}:{want[DECODE]}"
    live = [w for w in inp.workers if w.state != GONE]
    have_p, to_role, short, movable, pinned, stuck = _gap(live, want[PREFILL])
    have = {PREFILL: have_p, DECODE: len(live) - have_p}
    text = f"{label} (now {have_p}:{have[DECODE]})"
    conflicts: list[str] = []
    flips: tuple[Flip, ...] = ()
    if sum(want.values()) != len(live):
        conflicts.append(f"{label} needs {sum(want.values())} workers but {len(live)} are not "
                         "gone: roles held until the workers or the target change")
        text += ": size mismatch, roles held"
    elif to_role is None:
        text += ": met"
    else:
        giver = _other(to_role)
        # One batch of flips lands before the next is ordered: a worker that has switched but
        # still shows as SWITCHING would otherwise be counted in its old role and replaced.
        n = 0 if in_flight else min(short, cfg.max_flips_per_tick)
        flips = tuple(Flip(w.address, giver, to_role, label) for w in movable[:n])
        text += f": {short} {giver}->{to_role} needed"
        if in_flight:
            text += f", waiting on the flip of {', '.join(w.address for w in in_flight)}"
        elif flips:
            text += f", flip {', '.join(f.address for f in flips)}"
        if len(movable) < short and pinned:
            conflicts.append(f"{label} is {short - len(movable)} {to_role} short: pinned "
                             f"{giver} workers {', '.join(pinned)} are not moved")
        if len(movable) < short and stuck:
            text += f"; not serving: {', '.join(stuck)}"
    for role in ROLES:
        if want[role] < cfg.min_per_role:
            conflicts.append(f"{label} leaves {want[role]} {role} workers, "
                             f"under min_per_role {cfg.min_per_role}")
    # What pressure alone would do: a role sustained above `high`, the other below `low`.
    for role, since in ((PREFILL, state.prefill_high_since_s),
                        (DECODE, state.decode_high_since_s)):
        if (since is not None and now - since >= cfg.sustain_s
                and _ratio(inp, _other(role)) < cfg.low and want[role] <= have[role]):
            conflicts.append(f"{label} holds while {role} pressure is {_ratio(inp, role):.2f} "
                             f"({_other(role)} {_ratio(inp, _other(role)):.2f})")
    return flips, text, tuple(conflicts)


def _fluid_token(inp: ControllerInput, cfg: PolicyConfig, leaving: set[str]
                 ) -> tuple[tuple[OffloadBudget, ...], str]:
    if inp.prefill.ratio <= cfg.high:
        return (), ""
    head = f"prefill {inp.prefill.ratio:.2f} > {cfg.high:g}"
    if inp.decode.ratio >= cfg.high:
        return (), f"no offload: {head} but decode {inp.decode.ratio:.2f} has no slack"
    budgets, notes = [], []
    for w in sorted(inp.workers, key=lambda w: w.address):
        # Pinned workers may take offloaded work: a budget changes no role.
        if w.role != DECODE or w.state != SERVING or w.to_role or w.address in leaving:
            continue
        got = offload_budget(w, inp.slo, inp.prefill.tokens_per_s, cfg)
        if isinstance(got, OffloadBudget):
            budgets.append(got)
            notes.append(f"{w.address} {got.max_tokens} tokens in {got.chunk_tokens}-token "
                         f"chunks (step {got.step_s:.3f} s)")
        else:
            notes.append(f"{w.address} none ({got})")
    return tuple(budgets), f"offload ({head}): {', '.join(notes) or 'no serving decode worker'}"


def offload_budget(w: WorkerView, slo: Slo, pool_tokens_per_s: float,
                   cfg: PolicyConfig = PolicyConfig()) -> OffloadBudget | str:
    """One decode worker's budget, or why it gets none (slack: KV occupancy at most
    offload_kv_max and no decode waiting for admission).

    - step_s: its measured decode step; unknown, half the ITL SLO (a conservative guess: a
      lightly loaded step is far shorter, so this leaves less headroom than it really has).
    - tps: its measured prefill rate, else the prefill pool's.
    - chunk_tokens = min(offload_max_tokens, floor((bound_s - step_s) x tps)) with bound_s the
      smaller of offload_itl_share x itl_s and ttft_share x ttft_s, so a step carrying one
      chunk, step_s + chunk_tokens / tps, stays within the ITL share, and at least one such
      step fits the TTFT share.
    - max_tokens = min(offload_max_tokens, chunk_tokens x floor(ttft_share x ttft_s /
      (step_s + chunk_tokens / tps))): what it prefills, one chunk a step, within the TTFT
      share the prefill queue is allowed, so the last offloaded token still meets the TTFT.
    """
    if w.kv_total_blocks <= 0:
        return "no KV report yet"
    occupancy = w.kv_used_blocks / w.kv_total_blocks
    if occupancy > cfg.offload_kv_max:
        return f"kv {occupancy:.2f} > {cfg.offload_kv_max:g}"
    if w.waiting > 0:
        return f"{w.waiting} decodes waiting"
    step_s = max(0.0, w.decode_step_s) if w.decode_step_s is not None else slo.itl_s / 2
    tps = w.prefill_tokens_per_s if w.prefill_tokens_per_s else pool_tokens_per_s
    if not (tps > 0 and math.isfinite(tps)):
        return "no prefill rate"
    bound_s = min(cfg.offload_itl_share * slo.itl_s, slo.queue_budget_s)
    headroom_s = bound_s - step_s
    chunk = min(cfg.offload_max_tokens, math.floor(headroom_s * tps)) if headroom_s > 0 else 0
    # floor() of a product can land one token over in floating point: step back until the
    # bound holds exactly as the worker will compute it.
    while chunk > 0 and step_s + chunk / tps > bound_s:
        chunk -= 1
    if chunk < cfg.offload_min_chunk_tokens:
        return (f"chunk {chunk} < {cfg.offload_min_chunk_tokens} tokens: "
                f"step {step_s:.3f} s of {bound_s:.3f} s")
    step_with_chunk_s = step_s + chunk / tps
    steps = math.floor(slo.queue_budget_s / step_with_chunk_s)
    max_tokens = min(cfg.offload_max_tokens, chunk * steps)
    if max_tokens < chunk:
        return f"no whole chunk fits the TTFT share: step {step_with_chunk_s:.3f} s"
    return OffloadBudget(w.address, max_tokens, chunk, step_with_chunk_s)


def plan_rebalance(workers: Sequence[WorkerView], prefill: int, decode: int
                   ) -> tuple[Flip, ...]:
    """The flips that take the workers that are not GONE to `prefill`:`decode`.

    Workers count as `to_role` when mid-flip, else as their role; only SERVING, unpinned
    workers move. With the total fixed, every flip goes the same way (from the role over its
    count to the one under), so the plan is the minimum number of flips and neither role ever
    drops below min(target, current) along it. Least loaded first, as `decide` chooses.
    Raises ValueError when the split has the wrong total or needs a pinned or busy worker.
    """
    if prefill < 0 or decode < 0:
        raise ValueError(f"prefill and decode must be >= 0, got {prefill=}, {decode=}")
    live = [w for w in workers if w.state != GONE]
    if prefill + decode != len(live):
        raise ValueError(f"prefill + decode = {prefill + decode}, but {len(live)} workers are "
                         "not gone: the split must cover them all")
    _, to_role, short, movable, pinned, stuck = _gap(live, prefill)
    if to_role is None:
        return ()
    giver = _other(to_role)
    if len(movable) < short:
        blockers = "".join(f"; {label}: {', '.join(names)}" for label, names
                           in (("pinned", pinned), ("not serving", stuck)) if names)
        raise ValueError(f"split prefill={prefill}, decode={decode} needs {short} {giver} "
                         f"workers moved to {to_role}, but only {len(movable)} can move"
                         f"{blockers}")
    label = f"rebalance to {prefill}:{decode}"
    return tuple(Flip(w.address, giver, to_role, label) for w in movable[:short])
