"""The controller in the simulator's loop: the router's own signals answer, the controller's own
view of it, the real `decide()`.

Owns the tick's glue, as the controller service's `tick` does it: the router's `RequestSignals`
ring (finished requests' samples, fed by the cluster), its `GetSignals` handler answering from
the simulated membership on the virtual clock, the controller's `cluster_view` with its
`Meters`, and the `PolicyState` carried from tick to tick. Must not decide anything: flips and
budgets come from `decide()`, and the cluster carries them out.
"""

from __future__ import annotations

from pdserve.controller.policy import ControllerInput, Decision, PolicyState, decide
from pdserve.controller.signals import Slo
from pdserve.controller.view import ClusterView, Meters, cluster_view
from pdserve.proto import router_pb2 as rpb
from pdserve.router.control import RequestSignals, RouterControlServicer, Sample, tpot_of


class SimController:
    def __init__(self, members, policy_cfg, slo: Slo, window_s: float,
                 pressure_window_s: float) -> None:
        """`members`: an object whose `members()` lists the router's `Member`s."""
        self.policy_cfg = policy_cfg
        self.slo = slo
        self.window_s = window_s
        self.pressure_window_s = pressure_window_s
        self.now = 0.0
        self.signals = RequestSignals()
        self.router = RouterControlServicer(members, self.signals, clock=lambda: self.now)
        self.meters = Meters()
        self.state = PolicyState()
        self.ticks = 0
        self.last_view: ClusterView | None = None

    def started(self) -> None:
        self.signals.started()

    def finished(self, now: float, e2e_s: float, ttft_s: float, prompt_tokens: int,
                 output_tokens: int, offloaded: bool) -> None:
        self.signals.finished(Sample(now, ttft_s, tpot_of(e2e_s, ttft_s, output_tokens),
                                     prompt_tokens, output_tokens, offloaded, 0, "length"))

    def tick(self, now: float, switching: dict[str, str],
             last_flip_s: dict[str, float]) -> Decision:
        self.now = now
        signals = self.router.GetSignals(rpb.GetSignalsRequest(window_s=self.window_s), None)
        view = cluster_view(signals, self.meters, self.slo, switching=switching,
                            last_flip_s=last_flip_s, pressure_window_s=self.pressure_window_s)
        self.last_view = view
        inp = ControllerInput(view.workers, view.prefill, view.decode, self.slo, self.state, None)
        d = decide(inp, now, self.policy_cfg)
        self.state = d.state
        self.ticks += 1
        return d
