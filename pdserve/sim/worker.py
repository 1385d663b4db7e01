"""One simulated worker: a role, a state, the engine model, and its steps' timing.

Owns a worker's step in time: plan it (the scheduler's batch, or a run of pure decode steps
taken as one event: `engine_model.decode_run`), its duration from the `StepProfile`, cutting a
run short when a request joins mid-run (the run ends with the step in progress, as the engine
would admit the newcomer at the next step), and the counters a stats poll reports. Must not
route or decide flips; the cluster calls it.

Run timing: the step times of a k-step decode run are taken as linear in the context, which
grows by the batch size each step: step j takes d0 + j x slope, with d0 and the last step's
time from the profile (exact for a profile linear in context tokens).
"""

from __future__ import annotations

import math

from pdserve.core.roles import DRAINING, SERVING, SWITCHING
from pdserve.sim.engine_model import EngineModel, PlannedStep
from pdserve.proto import worker_pb2 as wpb
from pdserve.wire import role_to_proto

MAX_RUN_STEPS = 1 << 20


def step_seconds(profile, step: PlannedStep) -> float:
    return profile.work_s(step.prefill_tokens, step.decode_batch, step.context_tokens,
                          step.cached_tokens, step.attn_pairs)


class Run:
    """k pure decode steps from `start_s`: step j (0-based) takes d0 + j x slope seconds."""

    __slots__ = ("start_s", "k", "d0", "slope")

    def __init__(self, start_s: float, k: int, d0: float, slope: float) -> None:
        self.start_s, self.k, self.d0, self.slope = start_s, k, d0, slope

    def elapsed(self, j: int) -> float:
        """Seconds the first j steps take."""
        return j * self.d0 + self.slope * j * (j - 1) / 2

    def steps_done_by(self, t: float) -> int:
        """Steps wholly done by time t."""
        dt = t - self.start_s
        a, b = self.slope / 2, self.d0 - self.slope / 2
        if abs(a) < 1e-15:
            j = int(dt / self.d0) if self.d0 > 0 else self.k
        else:
            disc = b * b + 4 * a * dt
            j = int((-b + math.sqrt(max(0.0, disc))) / (2 * a))
        j = max(0, min(self.k, j))
        while j < self.k and self.elapsed(j + 1) <= dt:
            j += 1
        while j > 0 and self.elapsed(j) > dt:
            j -= 1
        return j


class SimWorker:
    def __init__(self, address: str, role: str, engine: EngineModel, state: str = SERVING
                 ) -> None:
        self.address = address
        self.role = role
        self.state = state
        self.engine = engine
        self.to_role: str | None = None
        self.drain_started_s = 0.0
        self.token = 0  # the live step event's token; an event with another is stale
        self.step: PlannedStep | None = None
        self.run: Run | None = None
        self.step_start_s = 0.0
        self.step_end_s = 0.0
        self.inbound = 0  # requests on their way here (a store fetch or a KV transfer)
        self.joins: list = []  # requests arrived during a step: they join at its end
        self.busy_s = 0.0
        self.decode_steps = 0
        self.decode_step_s = 0.0
        self.steps = 0
        self.finished = 0
        self.switches = 0

    @property
    def busy(self) -> bool:
        return self.step is not None or self.run is not None

    def start(self, now: float, profile) -> float | None:
        """Plan the next step (or run) from `now`; its end time, or None when idle."""
        k, batch, ctx = self.engine.decode_run(MAX_RUN_STEPS)
        self.token += 1
        self.step_start_s = now
        if k >= 2:
            d0 = profile.decode_s(batch, ctx)
            last = profile.decode_s(batch, ctx + (k - 1) * batch)
            self.run = Run(now, k, d0, (last - d0) / (k - 1))
            self.step_end_s = now + self.run.elapsed(k)
            return self.step_end_s
        step = self.engine.plan()
        if step is None:
            return None
        self.step = step
        self.step_end_s = now + step_seconds(profile, step)
        return self.step_end_s

    def cut_run(self, now: float) -> float | None:
        """A request joined during a run: the run ends with the step in progress. The new end
        time if it moved (the old step event is then stale), else None."""
        run = self.run
        if run is None:
            return None
        m = min(run.k, run.steps_done_by(now) + 1)
        if m >= run.k:
            return None
        run.k = m
        self.token += 1
        self.step_end_s = run.start_s + run.elapsed(m)
        return self.step_end_s

    def finish_step(self) -> tuple[list[tuple[str, str]], float]:
        """Apply the step (or run) that just ended: the engine's events and its duration."""
        dur = self.step_end_s - self.step_start_s
        self.busy_s += dur
        if self.run is not None:
            k = self.run.k
            self.run = None
            self.decode_steps += k
            self.decode_step_s += dur
            self.steps += k
            return [(rid, "done") for rid in self.engine.run_decode(k)], dur
        step, self.step = self.step, None
        assert step is not None  # a step ends only after one started
        self.steps += 1
        if step.prefill_tokens == 0:
            self.decode_steps += 1
            self.decode_step_s += dur
        return self.engine.complete(step), dur

    def stats(self) -> wpb.WorkerStats:
        """What the worker answers a stats poll with (during a run: as of the run's start)."""
        e = self.engine
        return wpb.WorkerStats(
            role=role_to_proto(self.role),
            num_running=e.running, num_waiting=e.waiting, num_free_blocks=e.free_blocks,
            num_total_blocks=e.total_blocks, draining=self.state in (DRAINING, SWITCHING),
            prompt_tokens_computed=e.prompt_tokens_computed, busy_seconds=self.busy_s,
            decode_steps=self.decode_steps, decode_step_seconds=self.decode_step_s,
            requests_finished=self.finished, role_switches=self.switches)

    def drained(self) -> bool:
        return self.inbound == 0 and not self.joins and not self.busy and self.engine.idle()
