"""Workers coming into and leaving the simulated cluster's pools: a cold start ending, and the
flips the controller orders, carried out as the live `Flipper` does.

Owns `Flips`: a flip begun (the worker drains, out of its pool; a decode worker's running
requests moved with their KV through `migration.Migrations` where the flip says so), then its
switch after the profile's flip time, or its failure at the drain deadline (the worker keeps its
role and what it holds, out of both pools until re-admitted), each outcome handed to the
controller; a worker's prefix cache followed in its new role (`feed`: the KV index, and the
decode workers' count of holders per block); and the report's workers per role over time
(`roles`).
Must not decide a flip nor when one is due: the controller orders it, and the cluster's `_wake`
calls `switch` once the worker has drained.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pdserve.controller.flip import FlipOutcome
from pdserve.core.roles import ACTIVE, DECODE, DRAINING, FAILED, PREFILL, SERVING, SWITCHING
from pdserve.core.roles import DRAINING as W_DRAINING

if TYPE_CHECKING:
    from pdserve.sim.cluster import Cluster
    from pdserve.sim.worker import SimWorker


class Flips:
    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster
        # Workers whose flip failed (drain timeout), out of both pools until re-admitted; and
        # for each flip under way, how to tell the controller its outcome.
        self.failed: set[str] = set()
        self._flips: dict[str, tuple] = {}

    # ---- what the controller's connector asks, through the cluster ---------------------------
    def switching(self) -> dict[str, str]:
        return {a: w.to_role for a, w in self.c.workers.items()
                if w.state in (W_DRAINING, SWITCHING) and w.to_role}

    def begin_flip(self, address: str, to_role: str, drain_timeout_s: float, done,
                   migrate: bool = False) -> None:
        """Drain `address` for a switch to `to_role` (`switched` or `drain_deadline` ends
        it and calls `done(outcome)`); nothing when it is not serving in the other role.
        `migrate`: a decode worker's running requests move to other decode workers."""
        c = self.c
        w, now = c.workers[address], c.q.now
        if w.state != SERVING or w.role == to_role:
            return
        if migrate:
            c.moves.drain(w)
        w.state, w.to_role, w.drain_started_s = W_DRAINING, to_role, now
        self._flips[address] = (done, w.role, now)
        c.router.set_state(w.address, DRAINING, None, f"switching to {to_role}", now)
        c.q.push(now + drain_timeout_s, "drain_deadline", (w.address, now))
        self.roles()
        c._wake(w)

    def readmit(self, address: str, reason: str) -> str | None:
        """A worker whose flip failed back into its role's pool, as the live `Flipper` does."""
        c = self.c
        w = c.workers[address]
        if w.state != SERVING:
            return None
        self.failed.discard(address)
        c.router.set_state(address, ACTIVE, w.role, reason, c.q.now)
        self.roles()
        c._wake(w)
        return w.role

    # ---- the cluster's events ------------------------------------------------------------------
    def drain_deadline(self, payload) -> None:
        """A flip still draining at its deadline fails, as the live `Flipper`'s does: the
        worker keeps its role and what it holds, out of both pools until re-admitted."""
        c = self.c
        address, started = payload
        w, now = c.workers[address], c.q.now
        if w.state != W_DRAINING or w.drain_started_s != started:
            return  # it switched meanwhile
        to_role, (done, from_role, _) = w.to_role, self._flips.pop(address)
        moved = c.moves.drained(address)  # a round under way ends; no new one starts
        w.state, w.to_role = SERVING, None
        c.counts["failed_flips"] += 1
        c.counts["drain_s"] += now - started
        self.failed.add(address)
        c.router.set_state(address, FAILED, None, "flip failed: drain_timeout_s", now)
        self.roles()
        c._wake(w)
        done(FlipOutcome(address, from_role, to_role or "?", False, now - started,
                         "drain_timeout_s", moved_requests=moved))

    def switch(self, w: SimWorker) -> None:
        c = self.c
        now = c.q.now
        w.state = SWITCHING
        c.counts["drain_s"] += now - w.drain_started_s
        c.counts["switch_s"] += c.profile.flip_s
        c.q.push(now + c.profile.flip_s, "switched", w.address)

    def switched(self, address: str) -> None:
        c = self.c
        w, now = c.workers[address], c.q.now
        assert w.to_role is not None  # a switch starts with its target role
        w.role, w.state, w.to_role = w.to_role, SERVING, None
        w.switches += 1
        c.counts["flips"] += 1
        c.router.set_state(address, ACTIVE, w.role, f"switched to {w.role}", now)
        self.feed(w)
        self.roles()
        c._wake(w)
        done, from_role, started = self._flips.pop(address)
        done(FlipOutcome(address, from_role, w.role, True, now - started,
                         moved_requests=c.moves.drained(address)))

    def feed(self, w: SimWorker) -> None:
        """The index follows `w`'s prefix cache while it prefills: from a snapshot when it
        turns prefill (as a router resyncs), and not at all while it decodes; the decode
        workers' count of holders per block counts its cache while it decodes."""
        c = self.c
        recorder, held = w.engine.recorder, c._decode_held
        counted = w.role == DECODE and c.cfg.max_local_prefill_tokens > 0
        if counted != (recorder.holders is not None):
            for h in w.engine.pool.by_hash:
                left = held.get(h, 0) + (1 if counted else -1)
                if left:
                    held[h] = left
                else:
                    del held[h]
            recorder.holders = held if counted else None
        if c.router.kv_aware:
            w.engine.recorder.keep = w.role == PREFILL
            w.engine.block_events()  # changes already in the snapshot, or not followed
            c.router.resync(w.address, w.engine.pool.cached_hashes()
                            if w.role == PREFILL else [])

    def ready(self, address: str) -> None:
        c = self.c
        w = c.workers[address]
        w.state = SERVING
        c.router.set_state(address, ACTIVE, w.role, "started", c.q.now)
        self.roles()
        c._wake(w)

    def roles(self) -> None:
        c = self.c
        p = d = moving = 0
        for a, w in c.workers.items():
            if w.state == SERVING and a not in self.failed:
                p += w.role == PREFILL
                d += w.role == DECODE
            elif w.state in (W_DRAINING, SWITCHING):
                moving += 1
        entry = (c.q.now, p, d, moving)
        if c.report.roles and c.report.roles[-1][0] == c.q.now:
            c.report.roles[-1] = entry
        else:
            c.report.roles.append(entry)
