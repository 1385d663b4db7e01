"""The controller's loop and its operator actions: observe, decide, act (or only advise).

Owns the controller's state between ticks: mode, pins, the operator's target split, the policy's
hysteresis state, each worker's last flip. Each tick reads the router's signals, builds the
policy input (`view`), asks the pure `policy.decide`, appends the decision with its inputs to
the audit log, exports metrics, and, in `active` mode only, sets the router's prefill offload
budgets, starts the decided flips, and re-admits workers whose flip failed once they have sat
out `failed_readmit_s`; all of it through a `connector.Connector`, so the same tick runs the
live cluster (`LiveConnector`) and the simulated one (`sim/control.py`). On stop, flips in
flight get up to `STOP_FLIPS_WAIT_S` to end and be logged. Operator actions (set-role,
rebalance, pin, mode) record their flips the same way. A manual role command sets the target
split; the policy then never moves away from it until `release()`.
Must not decide flips itself (the policy does) or sit on the request path.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict, dataclass, field, replace

import grpc

from pdserve.controller.audit import AuditLog
from pdserve.controller.config import ControllerConfig
from pdserve.controller.connector import Connector, OperatorFlips
from pdserve.controller.flip import FlipOutcome, MigrateOutcome
from pdserve.controller.metrics import ControllerMetrics
from pdserve.controller.policy import (ControllerInput, Decision, PolicyConfig, PolicyState,
                                       decide, plan_rebalance)
from pdserve.core.migration import BALANCE
from pdserve.core.roles import DECODE, GONE, PREFILL
from pdserve.controller.projection import StepModel
from pdserve.controller.signals import Slo
from pdserve.core.step_profile import load_profile
from pdserve.controller.view import ClusterView, Meters, cluster_view

# Who an automatic action's audit line names: the controller's own policy.
AUTOMATIC = "policy"

log = logging.getLogger(__name__)
# On stop, how long flips in flight may take to end and be logged before the channel closes.
STOP_FLIPS_WAIT_S = 10.0


class UnknownWorker(KeyError):
    """No worker with this address is known to the router."""


@dataclass
class FlipRecord:
    at_s: float
    reason: str
    ok: bool = True


@dataclass
class Snapshot:
    """What `status` shows: the last tick's view and decision."""

    view: ClusterView | None = None
    decision: Decision | None = None
    at_s: float = 0.0
    conflicts: list[str] = field(default_factory=list)


def reason_label(d: Decision, inp: ControllerInput, high: float) -> str:
    """A low-cardinality reason for the decisions counter (the full reason is in the log)."""
    if d.action == "target":
        return "operator_target"
    if d.flips:
        return f"{d.flips[0].to_role}_pressure"
    if d.budgets:
        return "prefill_pressure_offload"
    if inp.prefill.ratio > high and inp.decode.ratio > high:
        return "both_pressured"
    if inp.prefill.ratio > high or inp.decode.ratio > high:
        return "pressured_no_action"
    return "within_slo"


class Controller:
    """`policy_cfg`, `slo` and `step_prior`: the ones `cfg` implies unless given (the simulator
    passes its own, with thresholds the command line does not set, and its step profile)."""

    def __init__(self, cfg: ControllerConfig, connector: Connector, clock=time.monotonic,
                 policy_cfg: PolicyConfig | None = None, slo: Slo | None = None,
                 step_prior: StepModel | None = None) -> None:
        self.cfg = cfg
        self.connector = connector
        self.clock = clock
        self.mode = cfg.mode
        self.slo = slo or Slo(ttft_s=cfg.ttft_slo_ms / 1000, itl_s=cfg.itl_slo_ms / 1000,
                              ttft_share=cfg.ttft_share)
        self.policy_cfg = replace(policy_cfg, balance=policy_cfg.balance and cfg.migrate) \
            if policy_cfg else PolicyConfig(
                fluid_role=cfg.fluid_role, fluid_token=cfg.fluid_token,
                max_flips_per_tick=cfg.max_flips_per_tick, cooldown_s=cfg.cooldown_s,
                min_per_role=cfg.min_per_role, sustain_s=cfg.sustain_s, balance=cfg.migrate)
        self.step_prior = step_prior or (StepModel(f"profile {cfg.step_profile}",
                                                   profile=load_profile(cfg.step_profile))
                                         if cfg.step_profile else None)
        self.metrics = ControllerMetrics()
        self.audit = AuditLog(cfg.audit_log, cfg.audit_max_bytes)
        self.meters = Meters()
        self.state = PolicyState()
        self.pinned: set[str] = set()
        self.target: tuple[int, int] | None = None
        self.flips: dict[str, FlipRecord] = {}
        self.failed_at: dict[str, float] = {}
        self.flips_total = 0
        self.migrating: set[str] = set()  # decode workers with a migration under way
        self.migrations_total = 0  # running decodes the controller moved to even out load
        self.ticks = 0
        self.snapshot = Snapshot()
        self._budgets: tuple = ()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the loop ---------------------------------------------------------------------------
    def start(self) -> "Controller":
        self._thread = threading.Thread(target=self._run, name="controller-tick", daemon=True)
        self._thread.start()
        return self

    def stop(self, flips_wait_s: float = STOP_FLIPS_WAIT_S) -> None:
        """Stop ticking; flips in flight get up to `flips_wait_s` to end and be logged before
        the router channel closes (closing it under a flip cancels the controller's side of it
        while the worker may still switch: the audit would say failed for a flip that happened)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.connector.close(flips_wait_s)

    def _run(self) -> None:
        while not self._stop.wait(self.cfg.tick_s):
            try:
                start = time.perf_counter()
                self.tick()
                self.metrics.tick_seconds.labels("whole").observe(time.perf_counter() - start)
            except grpc.RpcError as e:
                log.warning("tick: router unreachable (%s: %s)", e.code().name, e.details())
            except Exception:  # a bad tick must not end the loop; the next one starts afresh
                log.exception("tick failed")

    def observe(self) -> ClusterView:
        signals = self.connector.signals(self.cfg.window_s)
        with self._lock:
            last = {a: r.at_s for a, r in self.flips.items()}
            view = cluster_view(signals, self.meters, self.slo, pinned=frozenset(self.pinned),
                                switching=self.connector.switching(), last_flip_s=last,
                                pressure_window_s=self.cfg.pressure_window_s,
                                step_prior=self.step_prior, now=self.clock())
        self.metrics.offloaded_total(signals.offloaded_tokens_total)
        counts: dict[tuple[str, str], int] = {}
        for w in view.workers:
            counts[(w.role, w.state)] = counts.get((w.role, w.state), 0) + 1
        self.metrics.set_workers(counts)
        self.metrics.pressure.labels("prefill").set(view.prefill.ratio)
        self.metrics.pressure.labels("decode").set(view.decode.ratio)
        return view

    def tick(self) -> Decision | None:
        now = self.clock()
        start = time.perf_counter()
        view = self.observe()
        self.metrics.tick_seconds.labels("observe").observe(time.perf_counter() - start)
        with self._lock:
            self.ticks += 1
            mode, target = self.mode, self.target
            if mode == "off":
                self.snapshot = Snapshot(view, None, now, self._failures())
                self._set_budgets(())
                return None
            inp = ControllerInput(view.workers, view.prefill, view.decode, self.slo,
                                  self.state, target, view.step_model,
                                  view.decode_tokens_per_s)
            start = time.perf_counter()
            d = decide(inp, now, self.policy_cfg)
            self.metrics.tick_seconds.labels("decide").observe(time.perf_counter() - start)
            self.state = d.state
            acted = mode == "active"
            self.metrics.decisions.labels(d.action, reason_label(d, inp, self.policy_cfg.high)
                                          ).inc()
            self.snapshot = Snapshot(view, d, now, [*d.conflicts, *self._failures()])
        if self.audit.path:  # the record is built only for a log that keeps it
            self.audit.write({"event": "decision", "t": time.time(), "mode": mode,
                              "acted": acted, "input": _input_record(inp, view),
                              "decision": _decision_record(d)})
        if d.action != "hold":
            log.info("%s%s: %s", d.action, "" if acted else " (advisory)", d.reason)
        if acted:
            self._set_budgets(d.budgets)
            for f in d.flips:
                self.start_flip(f.address, f.to_role, f.reason)
            for m in d.migrations if self.cfg.migrate else ():
                self.start_migration(m.address, m.count, m.reason)
            self._readmit(view, now)
        else:
            self._set_budgets(())
        return d

    def _failures(self) -> list[str]:
        return [f"{a}: flip failed {self.clock() - t:.0f}s ago ({self.flips[a].reason}); out of "
                f"both pools" for a, t in self.failed_at.items() if a in self.flips]

    def _set_budgets(self, budgets) -> None:
        if tuple(budgets) == self._budgets:
            return
        self.connector.set_budgets(budgets)
        self._budgets = tuple(budgets)

    def _readmit(self, view: ClusterView, now: float) -> None:
        for a, t in list(self.failed_at.items()):
            if now - t < self.cfg.failed_readmit_s or a in self.connector.switching():
                continue
            role = self.connector.readmit(a, f"re-admitted {now - t:.0f}s after a failed flip")
            if role is not None:
                self.failed_at.pop(a, None)
                self.audit.write({"event": "readmit", "t": time.time(), "address": a,
                                  "role": role})

    # ---- flips ------------------------------------------------------------------------------
    def _flip(self, address: str, to_role: str, reason: str, drain_timeout_s: float,
              by: str = AUTOMATIC, migrate: bool = True) -> FlipOutcome:
        """An operator's flip, carried out before returning (a cluster with operators: the
        live one's connector; the simulated cluster's flips are the policy's only).
        `migrate` False: no decode worker is left to take a decode worker's running requests,
        so they finish in place."""
        if not isinstance(self.connector, OperatorFlips):
            raise TypeError(f"{type(self.connector).__name__} carries out no operator flips")
        out = self.connector.flip(address, to_role, drain_timeout_s, reason, migrate)
        self.flipped(out, reason, by)
        return out

    def flipped(self, out: FlipOutcome, reason: str, by: str = AUTOMATIC) -> None:
        """A flip ended: its record (the cooldown's clock; a failed one sits out), metrics and
        audit line."""
        address = out.address
        now = self.clock()
        with self._lock:
            if out.ok and out.from_role != out.to_role:
                self.flips[address] = FlipRecord(now, reason)
                self.failed_at.pop(address, None)
                self.flips_total += 1
                self.metrics.role_switches.labels(out.from_role, out.to_role).inc()
                self.metrics.role_switch_seconds.observe(out.seconds)
            elif not out.ok:
                self.flips[address] = FlipRecord(now, f"{reason}; failed: {out.error}", False)
                self.failed_at[address] = now
                self.metrics.role_switch_failures.labels(out.from_role, out.to_role).inc()
        self.audit.write({"event": "flip", "t": time.time(), "reason": reason, "by": by,
                          **asdict(out)})

    def start_flip(self, address: str, to_role: str, reason: str) -> None:
        """A policy's flip, in the background (a drain may take seconds); `flipped` records it
        when it ends."""
        self.connector.start_flip(address, to_role, reason, self.cfg.drain_timeout_s,
                                  self.flipped, migrate=self.cfg.migrate)

    def start_migration(self, address: str, count: int, reason: str) -> None:
        """A policy's move of running decodes off a decode worker, in the background."""
        with self._lock:
            if address in self.migrating:
                return  # the last one is still under way: its effect is not in the view yet
            self.migrating.add(address)
        # The worker counts the move under BALANCE; the audit keeps the policy's why.
        self.connector.migrate(address, count, BALANCE, lambda out: self.migrated(out, reason))

    def migrated(self, out: MigrateOutcome, reason: str) -> None:
        with self._lock:
            self.migrating.discard(out.address)
            self.migrations_total += out.moved
        self.audit.write({"event": "migrate", "t": time.time(), "reason": reason,
                          **asdict(out)})

    # ---- operator actions -------------------------------------------------------------------
    def _workers(self):
        view = self.observe()
        return view, {w.address: w for w in view.workers}

    def _known(self, address: str, workers: dict) -> None:
        if address not in workers:
            raise UnknownWorker(f"unknown worker {address!r}; known: "
                                f"{', '.join(sorted(workers)) or 'none'}")

    def set_role(self, address: str, role: str, drain_timeout_s: float = 0.0,
                 by: str = "") -> FlipOutcome:
        view, workers = self._workers()
        self._known(address, workers)
        counts = {PREFILL: 0, DECODE: 0}
        for w in view.workers:
            if w.state != GONE:
                counts[role if w.address == address else w.role] += 1
        with self._lock:
            # A manual flip is the operator's split from now on, until released.
            self.target = (counts[PREFILL], counts[DECODE])
        return self._flip(address, role, "operator set-role",
                          drain_timeout_s or self.cfg.drain_timeout_s, by,
                          migrate=counts[DECODE] > 0)

    def rebalance(self, prefill: int, decode: int, dry_run: bool, drain_timeout_s: float = 0.0,
                  by: str = "") -> tuple[tuple, list[FlipOutcome]]:
        view, _ = self._workers()
        plan = plan_rebalance(view.workers, prefill, decode)  # ValueError names the field
        if dry_run:
            return plan, []
        with self._lock:
            self.target = (prefill, decode)
        self.audit.write({"event": "rebalance", "t": time.time(), "prefill": prefill,
                          "decode": decode, "plan": [asdict(f) for f in plan], "by": by})
        results = [self._flip(f.address, f.to_role, f"operator rebalance to {prefill}:{decode}",
                              drain_timeout_s or self.cfg.drain_timeout_s, by,
                              migrate=decode > 0) for f in plan]
        return plan, results

    def release(self, by: str = "") -> bool:
        with self._lock:
            had, self.target = self.target is not None, None
        self.audit.write({"event": "release", "t": time.time(), "had_target": had, "by": by})
        return had

    def pin(self, address: str, pinned: bool, by: str = "") -> None:
        _, workers = self._workers()
        self._known(address, workers)
        with self._lock:
            (self.pinned.add if pinned else self.pinned.discard)(address)
        self.audit.write({"event": "pin" if pinned else "unpin", "t": time.time(),
                          "address": address, "by": by})

    def set_mode(self, mode: str, by: str = "") -> str:
        with self._lock:
            previous, self.mode = self.mode, mode
        self.audit.write({"event": "mode", "t": time.time(), "from": previous, "to": mode,
                          "by": by})
        if mode != "active":
            self._set_budgets(())
        return previous


def _input_record(inp: ControllerInput, view: ClusterView) -> dict:
    return {"prefill": asdict(inp.prefill), "decode": asdict(inp.decode),
            "state": asdict(inp.state), "target": inp.target,
            "decode_tokens_per_s": inp.decode_tokens_per_s,
            "window": asdict(view.window), "recent": asdict(view.recent),
            "workers": [{"address": w.address, "role": w.role, "state": w.state,
                         "pinned": w.pinned, "running": w.running, "waiting": w.waiting,
                         "kv_used_blocks": w.kv_used_blocks, "kv_total_blocks": w.kv_total_blocks,
                         "queued_prompt_tokens": w.queued_prompt_tokens,
                         "prefill_tokens_per_s": w.prefill_tokens_per_s,
                         "decode_step_s": w.decode_step_s,
                         "projected_step_s": w.projected_step_s} for w in inp.workers]}


def _decision_record(d: Decision) -> dict:
    return {"action": d.action, "reason": d.reason, "conflicts": list(d.conflicts),
            "flips": [asdict(f) for f in d.flips], "budgets": [asdict(b) for b in d.budgets]}
