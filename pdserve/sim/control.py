"""The controller in the simulator's loop: the router's signals built from simulated state,
turned into the policy's input by the controller's own `cluster_view`, decided by the real
`decide()`.

Owns the tick's glue, as the controller service's `tick` does it: a `RouterSignals` message
(members with their last reported stats, finished-request samples of the window), the
controller's `Meters` and `PolicyState` carried from tick to tick, the operator-free
`ControllerInput`. Must not decide anything: the flips and budgets come from `decide()`, and
the simulator's cluster carries them out.
"""

from __future__ import annotations

from collections import deque

from pdserve.controller.policy import ControllerInput, Decision, PolicyState, decide
from pdserve.controller.signals import Slo
from pdserve.controller.view import ClusterView, Meters, cluster_view
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import worker_pb2 as wpb
from pdserve.router.membership import ACTIVE, DRAINING, FAILED, GONE, PREFILL

_ROLE = {PREFILL: wpb.ROLE_PREFILL, "decode": wpb.ROLE_DECODE}
_STATE = {ACTIVE: rpb.MEMBER_STATE_ACTIVE, DRAINING: rpb.MEMBER_STATE_DRAINING,
          FAILED: rpb.MEMBER_STATE_FAILED, GONE: rpb.MEMBER_STATE_GONE}


class Samples:
    """Finished requests (end, ttft, tpot, prompt, output) kept for the controller's window."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self.items: deque[tuple[float, float, float, int, int]] = deque()

    def add(self, end_s: float, ttft_s: float, tpot_s: float, prompt: int, output: int) -> None:
        self.items.append((end_s, ttft_s, tpot_s, prompt, output))

    def recent(self, now: float) -> list[rpb.RequestSample]:
        while self.items and self.items[0][0] < now - self.window_s:
            self.items.popleft()
        return [rpb.RequestSample(age_s=now - e, ttft_s=t, tpot_s=p, prompt_tokens=n,
                                  output_tokens=o, finish="length")
                for e, t, p, n, o in self.items]


def signals_of(members, samples: list) -> rpb.RouterSignals:
    """The router's `GetSignals` answer for these `Membership` members."""
    out = rpb.RouterSignals(samples=samples)
    for m in members:
        wm = out.workers.add(address=m.address, role=_ROLE[m.role], state=_STATE[m.state],
                             in_flight=m.in_flight, in_flight_tokens=m.in_flight_tokens,
                             offload_in_flight_tokens=m.offload_tokens,
                             offload_budget_tokens=m.offload_budget)
        s = m.stats
        if s is not None:
            wm.stats.CopyFrom(wpb.WorkerStats(
                role=_ROLE[m.role], num_running=s.num_running, num_waiting=s.num_waiting,
                num_free_blocks=s.num_free_blocks, num_total_blocks=s.num_total_blocks,
                prompt_tokens_computed=s.prompt_tokens_computed, busy_seconds=s.busy_seconds,
                decode_steps=s.decode_steps, decode_step_seconds=s.decode_step_seconds,
                requests_finished=s.requests_finished, role_switches=s.role_switches,
                draining=s.draining))
    return out


class SimController:
    def __init__(self, policy_cfg, slo: Slo, window_s: float, pressure_window_s: float) -> None:
        self.policy_cfg = policy_cfg
        self.slo = slo
        self.pressure_window_s = pressure_window_s
        self.meters = Meters()
        self.state = PolicyState()
        self.samples = Samples(window_s)
        self.ticks = 0
        self.last_view: ClusterView | None = None

    def tick(self, members, now: float, switching: dict[str, str],
             last_flip_s: dict[str, float]) -> Decision:
        signals = signals_of(members, self.samples.recent(now))
        view = cluster_view(signals, self.meters, self.slo, switching=switching,
                            last_flip_s=last_flip_s, pressure_window_s=self.pressure_window_s)
        self.last_view = view
        inp = ControllerInput(view.workers, view.prefill, view.decode, self.slo, self.state, None)
        d = decide(inp, now, self.policy_cfg)
        self.state = d.state
        self.ticks += 1
        return d
