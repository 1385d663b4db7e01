"""The controller in the simulator's loop: the live `Controller` and its tick, through a
connector to the simulated cluster.

Owns `SimConnector`, the simulated side of `controller.connector.Connector`: the router's own
`RequestSignals` ring (finished requests' samples, fed by the cluster) and its `GetSignals`
handler answering from the simulated membership on the virtual clock; the offload budgets set
on the simulated router; flips begun on the simulated workers (drained, a decode worker's
running requests moved with their KV where `migrate` says so, then switched after the profile's
flip time, or failed at the drain deadline) and running decodes moved off a decode worker
keeping its role (`migrate`), with their outcomes handed back to the controller on the virtual
clock; a worker whose flip failed re-admitted. `controller(...)` builds the live
controller over it. Must not decide anything: the controller's `tick` and `decide()` do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.controller.config import ControllerConfig
from pdserve.controller.projection import StepModel
from pdserve.core.step_profile import StepProfile
from pdserve.controller.service import Controller
from pdserve.controller.signals import Slo
from pdserve.proto import router_pb2 as rpb
from pdserve.router.control import RequestSignals, RouterControlServicer, Sample, tpot_of

if TYPE_CHECKING:
    from pdserve.sim.cluster import Cluster


class SimConnector:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.ring = RequestSignals()
        self.control = RouterControlServicer(cluster.router, self.ring,
                                             clock=lambda: cluster.q.now)

    # What the live router's RequestSignals learn from its requests.
    def started(self, max_tokens: int) -> None:
        """A request admitted, its parameters read (a trace's request decodes to its length)."""
        self.ring.started()
        self.ring.expect_output(max_tokens)

    def finished(self, now: float, e2e_s: float, ttft_s: float, prompt_tokens: int,
                 output_tokens: int, offloaded: bool, route=None) -> None:
        """A request ended; `route`: the `route.Route` it took (its path and deflection)."""
        d = None if route is None else route.deflection
        self.ring.finished(Sample(
            now, ttft_s, tpot_of(e2e_s, ttft_s, output_tokens), prompt_tokens, output_tokens,
            offloaded, 0, "length", "" if route is None else route.kind,
            "" if d is None else d.choice, None if d is None else d.prefill_ttft_s,
            None if d is None else d.decode_ttft_s, output_tokens))

    # ---- controller.connector.Connector ------------------------------------------------------
    def signals(self, window_s: float) -> rpb.RouterSignals:
        return self.control.GetSignals(rpb.GetSignalsRequest(window_s=window_s), None)

    def switching(self) -> dict[str, str]:
        return self.cluster.switching()

    def set_budgets(self, budgets) -> None:
        self.cluster.router.set_budgets({b.address: (b.max_tokens, b.chunk_tokens, b.step_s)
                                         for b in budgets})

    def start_flip(self, address: str, to_role: str, reason: str, drain_timeout_s: float,
                   done, migrate: bool = True) -> None:
        self.cluster.begin_flip(address, to_role, drain_timeout_s,
                                lambda out: done(out, reason), migrate)

    def migrate(self, address: str, count: int, reason: str, done) -> None:
        self.cluster.migrate(address, count, reason, done)

    def readmit(self, address: str, reason: str) -> str | None:
        return self.cluster.readmit(address, reason)

    def close(self, wait_s: float) -> None:
        """Nothing to let go of: a flip ends in the cluster's own events."""


def controller(cluster: Cluster, policy_cfg, slo: Slo, tick_s: float, window_s: float,
               pressure_window_s: float, drain_timeout_s: float, failed_readmit_s: float,
               migrate: bool = ControllerConfig.migrate, profile: Any = None,
               block_size: int = 16) -> tuple[Controller, SimConnector]:
    """The live controller (active, no audit file, no operator) over `cluster`, on its
    virtual clock, projecting decode steps with the cluster's step profile (as the live
    controller does given it with `--step-profile`)."""
    step_prior = (StepModel(f"profile {profile.origin}", profile=profile, block_tokens=block_size)
                  if isinstance(profile, StepProfile) else None)
    connector = SimConnector(cluster)
    cfg = ControllerConfig(router_address="simulated", tick_s=tick_s, window_s=window_s,
                           pressure_window_s=pressure_window_s, drain_timeout_s=drain_timeout_s,
                           failed_readmit_s=failed_readmit_s, migrate=migrate)
    return (Controller(cfg, connector, clock=lambda: cluster.q.now, policy_cfg=policy_cfg,
                       slo=slo, step_prior=step_prior), connector)
