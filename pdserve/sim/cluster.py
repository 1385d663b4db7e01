"""The simulated cluster: requests, workers, links, the store, the router and the controller
joined on one event queue.

Owns what happens at each event: an arrival (admission, the prefill choice or an offload, the
store fetch), a worker's step ending (first tokens, the KV put into the store and its hand-off
to a decode worker, ends), a transfer landing, a stats poll, a controller tick and the flips it
orders (drain, then the profile's switch time; a decode worker's running requests moved with
their KV where the flip says so, and the controller's balance moves, through
`migration.Migrations`), and the per-request records. Must not score, admit, schedule or decide
itself: the real cores do (through `router.SimRouter`, `engine_model.EngineModel` and the live
controller through `control.SimConnector`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.controller.flip import FlipOutcome
from pdserve.core.roles import (ACTIVE, DECODE, DRAINING, FAILED, PREFILL, SERVING, STARTING,
                                SWITCHING)
from pdserve.core.roles import DRAINING as W_DRAINING
from pdserve.controller.signals import Slo
from pdserve.router.admission import Overloaded, Ticket
from pdserve.router.policy import NoWorkerError
from pdserve.router.retry import RetryPolicy
from pdserve.router.route import (CACHED_LOCAL, DECODE_FALLBACK, FALLBACK, OFFLOAD, PREFILL_HOP,
                                  Failure, after_failure, plan)
from pdserve.sim.config import SimConfig
from pdserve.sim.control import SimConnector, controller
from pdserve.sim.engine_model import EngineModel
from pdserve.sim.events import EventQueue
from pdserve.sim.host import HostShare
from pdserve.sim.migration import Migrations
from pdserve.sim.network import KvStore, Link
from pdserve.sim.prompts import RequestPrompt, prompt_tokens_of
from pdserve.sim.report import NONE, OK, SimReport
from pdserve.sim.router import SimRouter
from pdserve.sim.trace import SimRequest, columns
from pdserve.sim.worker import SimWorker

if TYPE_CHECKING:
    from pdserve.controller.service import Controller


# The route's event when no prefill worker can take a request (`route.after_failure`).
_NO_PREFILL = Failure(PREFILL_HOP, None)
# With every request arrived and nothing stepping or moving for this long, the run is stuck:
# it ends, and the requests left are reported unfinished.
STALL_S = 600.0


class Cluster:
    def __init__(self, cfg: SimConfig, requests: Sequence[SimRequest], profile,
                 progress: Callable[[float, int, int], None] | None = None) -> None:
        self.cfg, self.reqs, self.profile, self.progress = cfg, requests, profile, progress
        self.q = EventQueue()
        n = len(requests)
        arrivals, prompt_tokens, output_tokens = columns(requests)
        self.arrivals: array = arrivals
        roles = [PREFILL] * cfg.prefill_workers + [DECODE] * cfg.decode_workers
        width = max(4, len(str(len(roles))))
        self.kv_blocks = cfg.kv_blocks or max(1, profile.kv_capacity_tokens // cfg.block_size)
        self.store = KvStore(cfg.store_capacity_blocks)
        # How many decode-role workers' caches hold each block (with conditional
        # disaggregation on): a block not in it is held by no decode worker, and
        # `_decode_cached` need not ask every decode cache about it.
        self._decode_held: dict[bytes, int] = {}
        self.router = SimRouter(cfg, {f"w{i:0{width}d}": r for i, r in enumerate(roles)},
                                store=self.store)
        # The KV index follows the prefix caches of prefill workers, the only ones it is asked
        # about for routing (a worker turning prefill is resynced from its cache: `_feed`);
        # for conditional disaggregation, decode workers' caches are read where they are, the
        # answer the index would give (`_decode_cached`).
        feed = self.router.kv_aware
        self.workers: dict[str, SimWorker] = {}
        for i, role in enumerate(roles):
            a = f"w{i:0{width}d}"
            engine = EngineModel(self.kv_blocks, cfg.block_size, cfg.max_num_seqs,
                                 cfg.max_num_batched_tokens, cfg.max_waiting,
                                 cfg.prefix_caching, record_events=feed and role == PREFILL)
            self.workers[a] = SimWorker(a, role, engine, STARTING if cfg.cold_start else SERVING)
            if role == DECODE and cfg.max_local_prefill_tokens > 0:
                engine.recorder.holders = self._decode_held
        self.host = HostShare.of(profile, cfg.workers_per_host, list(self.workers),
                                 cfg.host_background_threads)
        shared = Link("shared")
        self.links = {a: shared if cfg.link == "shared" else Link(a) for a in self.workers}
        self.slo = Slo(cfg.slo_ttft_ms / 1000.0, cfg.slo_itl_ms / 1000.0)
        self.retry = RetryPolicy()  # the live router's default
        # The live controller's tick, through its connector to this cluster (`control.py`).
        self.ctl: Controller | None = None
        self.connector: SimConnector | None = None
        if cfg.controller:
            self.ctl, self.connector = controller(
                self, cfg.policy, self.slo, cfg.tick_s, cfg.window_s, cfg.pressure_window_s,
                cfg.drain_timeout_s, cfg.failed_readmit_s, cfg.migrate, profile, cfg.block_size)
        self.bpt = cfg.block_size * profile.kv_bytes_per_token  # bytes per KV block
        self.report = SimReport(
            config={}, profile=getattr(profile, "origin", type(profile).__name__),
            requests=requests, arrival_s=arrivals, prompt_tokens=prompt_tokens,
            output_tokens=output_tokens, ttft_s=array("d", [NONE]) * n,
            end_s=array("d", [NONE]) * n, status=["unfinished"] * n,
            prefill_worker=[""] * n, decode_worker=[""] * n,
            slo_ttft_s=self.slo.ttft_s, slo_itl_s=self.slo.itl_s, workers=len(roles))
        self._statuses: dict[str, str] = {}  # one string per distinct status
        self.hashes: dict[int, list[bytes]] = {}
        # A request's prompt (its tokens and full blocks' hashes), until it is queued; a trace
        # may make its requests as they are read (`self.reqs[i]`), so no other state than
        # these maps is kept per request in flight.
        self.known: dict[int, RequestPrompt] = {}
        self.held: dict[int, tuple[str, float, int]] = {}  # router's in-flight count to release
        self.own: dict[int, Ticket] = {}  # prefill work queued in admission
        self.offloaded: set[int] = set()  # prefilled on a decode worker within its budget
        # Each request's route (its path and deflection), for its sample when it ends; kept
        # only with a controller to read the samples.
        self.routes: dict[int, Any] = {}
        self._decode_caches: tuple = (None, [])  # the decode pool; its engines and their caches
        self.store_hits: dict[int, tuple[int, int]] = {}
        self.unresolved = n
        self.arrived = 0
        self.last_work_s = 0.0
        self.stalled = False  # no step, transfer or arrival for STALL_S with requests left
        # Workers whose flip failed (drain timeout), out of both pools until re-admitted; and
        # for each flip under way, how to tell the controller its outcome.
        self.failed: set[str] = set()
        self._flips: dict[str, tuple] = {}
        self.moves = Migrations(self)  # running decodes moved with their KV
        self.counts = {"flips": 0, "failed_flips": 0, "drain_s": 0.0, "switch_s": 0.0,
                       "offloaded": 0, "local_prefills": 0,
                       "deflections_decode": 0, "deflections_prefill": 0,
                       "kv_transfers": 0, "kv_bytes": 0, "store_fetch_blocks": 0}

    # ---- the loop ------------------------------------------------------------------------------
    def run(self) -> SimReport:
        q = self.q
        if self.reqs:
            q.push(self.arrivals[0], "arrive", 0)
        q.push(0.0, "poll")
        if self.ctl is not None:
            q.push(self.cfg.tick_s, "tick")
        if self.cfg.cold_start:
            for a in self.workers:
                self.router.set_state(a, DRAINING, None, "starting", 0.0)
                q.push(self.profile.startup_s, "ready", a)
        self._roles()
        handlers: dict[str, Callable[[Any], None]] = {
            "arrive": self._arrive, "step": self._step, "link": self._link, "poll": self._poll,
            "tick": self._tick, "switched": self._switched, "ready": self._ready,
            "drain_deadline": self._drain_deadline}
        every = 1 << 16
        periodic = ("poll", "tick")
        while q and self.unresolved > 0 and not self.stalled:
            _, kind, payload = q.pop()
            handlers[kind](payload)
            if kind not in periodic:
                self.last_work_s = q.now
            if self.progress is not None and q.popped % every == 0:
                self.progress(q.now, len(self.reqs) - self.unresolved, len(self.reqs))
        if self.progress is not None:
            self.progress(q.now, len(self.reqs) - self.unresolved, len(self.reqs))
        c = self.counts
        c["events"] = q.popped
        c["steps"] = sum(w.steps for w in self.workers.values())
        c["prompt_tokens_computed"] = sum(w.engine.prompt_tokens_computed
                                          for w in self.workers.values())
        c["store_evicted_blocks"] = self.store.evicted
        c["controller_ticks"] = self.ctl.ticks if self.ctl else 0
        c["sim_end_s"] = q.now
        c["stalled_requests"] = self.unresolved if self.stalled else 0
        c.update(self.moves.counts())
        self.report.counts = c
        return self.report

    # ---- requests ------------------------------------------------------------------------------
    def _resolved(self, i: int, status: str) -> None:
        self.report.status[i] = self._statuses.setdefault(status, status)
        self.unresolved -= 1
        if self.routes:
            self.routes.pop(i, None)

    def _reject(self, i: int, reason: str) -> None:
        self._resolved(i, f"rejected: {reason}")
        self.hashes.pop(i, None)
        self.known.pop(i, None)

    def _arrive(self, i: int) -> None:
        now, router = self.q.now, self.router
        r = self.reqs[i]
        self.arrived = i + 1
        if i + 1 < len(self.arrivals):
            self.q.push(max(now, self.arrivals[i + 1]), "arrive", i + 1)
        try:
            router.admission.admit("", now)
        except Overloaded as e:
            self._reject(i, e.reason)
            return
        if self.connector is not None:
            self.connector.started(r.output_tokens)
        # The full blocks' hashes come from the trace's block ids (the scheduler takes them as
        # known); the router's are those of the reusable blocks (all tokens but the last).
        known = self.known[i] = RequestPrompt(self.reqs, i, r.prompt_tokens, self.cfg.block_size,
                                              self.cfg.prefix_block_tokens)
        hashes = self.hashes[i] = known[:(r.prompt_tokens - 1) // self.cfg.block_size]
        if self.cfg.admission.max_predicted_ttft_s > 0:
            cached, store = router.prefix(hashes)
            own = max(1, r.prompt_tokens - max([store, *cached.values()]) * self.cfg.block_size)
            try:
                ticket = router.admission.admit_prefill(own, router.prefill_rate(), self.q.now)
            except Overloaded as e:
                router.admission.release("")
                self._reject(i, e.reason)
                return
            self.own[i] = ticket
        # The live router's route (`router/route.py`), through this cluster's `Workers`.
        route = plan(self, i, self.cfg.max_local_prefill_tokens)
        kind, address = route.kind, route.address
        if route.deflection is not None:
            self.counts["deflections_" + route.deflection.choice] += 1
        if self.connector is not None:
            self.routes[i] = route
        if kind == CACHED_LOCAL:  # conditional disaggregation: it caches all but a short tail
            self.held[i] = (address, route.taken[0], 0)
            self.counts["local_prefills"] += 1
            self._on_decode(i, address)
            return
        if kind == OFFLOAD:
            self.held[i] = (address, 0.0, r.prompt_tokens)
            self.counts["offloaded"] += 1
            self.offloaded.add(i)
            self._on_decode(i, address, route.chunk_tokens)
            return
        if kind == DECODE_FALLBACK:  # no prefill worker: a decode worker prefills it
            if (after_failure(_NO_PREFILL, self.retry).action == FALLBACK
                    and self._prefill_on_decode(i)):
                return
            router.admission.release("")
            self._prefilled(i, answered=False)
            self._reject(i, "no prefill worker")
            return
        tokens = route.taken[0]
        self.held[i] = (address, tokens, 0)
        self.report.prefill_worker[i] = address
        w = self.workers[address]
        here = w.engine.cached_blocks(hashes)
        in_store = self.store.leading(hashes) if self.store.capacity else 0
        self.store_hits[i] = (here, in_store)
        if in_store > here:
            w.inbound += 1
            self.counts["store_fetch_blocks"] += in_store - here
            self._send(self.links[address], ("fetch", i, address), (in_store - here) * self.bpt)
        else:
            self._to_prefill(w, i)

    # ---- route.Workers: the simulated router's choices for request `i` -----------------------
    def take_cached_local(self, i: int, max_uncached_tokens: int
                          ) -> tuple[str, tuple[float, int], int] | None:
        r = self.reqs[i]
        return self.router.take_cached_local(self._decode_cached(self.hashes[i], r.prompt_tokens),
                                             r.prompt_tokens, r.output_tokens,
                                             max_uncached_tokens)

    def take_offload(self, i: int, prefill: tuple[str, tuple[float, int]] | None
                     ) -> tuple[tuple[str, tuple[float, int], int] | None, Any]:
        return self.router.take_offload(self.reqs[i].prompt_tokens, prefill)

    def choose_prefill(self, i: int) -> tuple[str, tuple[float, int]] | None:
        return self.router.choose_prefill(self.reqs[i].prompt_tokens, self.hashes[i])

    def take_prefill(self, i: int, exclude: frozenset[str],
                     chosen: tuple[str, tuple[float, int]] | None = None
                     ) -> tuple[str, tuple[float, int]] | None:
        # `exclude` is always empty here: a simulated prefill never fails, so none is retried.
        return self.router.take_prefill(self.reqs[i].prompt_tokens, self.hashes[i], chosen)

    def _decode_cached(self, hashes: list[bytes], prompt_tokens: int) -> dict[str, int]:
        """{ACTIVE decode worker: leading blocks of `hashes` its prefix cache holds} for those
        that can leave at most `max_local_prefill_tokens` uncached: they hold the chain up to
        its block `m` (so block `m` itself); a worker without it cannot qualify and is left
        out (a lookup per worker, not a walk of each one's chain)."""
        bs, limit = self.cfg.block_size, self.cfg.max_local_prefill_tokens
        m = max(0, -(-(prompt_tokens - limit) // bs) - 1)
        if m >= len(hashes):
            return {}
        h = hashes[m]
        pool = self.router.pool(DECODE)  # the same list until the membership changes
        if self._decode_caches[0] is not pool:
            self._decode_caches = (pool, [(a, self.workers[a].engine,
                                           self.workers[a].engine.pool.by_hash) for a in pool])
        if h not in self._decode_held:
            return {}
        return {a: engine.cached_blocks(hashes) for a, engine, cached in self._decode_caches[1]
                if h in cached}

    def _prefill_on_decode(self, i: int) -> bool:
        """No prefill worker: a decode worker takes the whole request (False: none can)."""
        r = self.reqs[i]
        try:
            address, tokens = self.router.pick(DECODE, r.prompt_tokens, r.output_tokens)
        except NoWorkerError:
            return False
        self.held[i] = (address, tokens, 0)
        self._on_decode(i, address)
        return True

    def _on_decode(self, i: int, address: str, chunk: int = 0) -> None:
        """The request prefills and decodes on decode worker `address` (its counts held)."""
        w, output_tokens = self.workers[address], self.reqs[i].output_tokens
        self.report.prefill_worker[i] = self.report.decode_worker[i] = address
        known = self.known.pop(i)
        self.hashes.pop(i, None)  # not read again: no hand-over
        self._join(w, lambda: w.engine.add(str(i), known, output_tokens, max_chunk_tokens=chunk))

    def _to_prefill(self, w: SimWorker, i: int) -> None:
        local, in_store = self.store_hits.pop(i, (0, 0))
        # Not read again before the hand-over (which names its blocks by the prefill's).
        hashes, known = self.hashes.pop(i), self.known.pop(i)

        def enter() -> None:
            if in_store > local:
                w.engine.import_cached(hashes[local:in_store])
            w.engine.add(str(i), known, 1, prefill_only=True)

        self._join(w, enter)

    def _prefilled(self, i: int, answered: bool = True) -> None:
        ticket = self.own.pop(i, None)
        if ticket is not None:
            self.router.admission.prefilled(ticket, self.q.now, answered)

    def _first_token(self, i: int, w: SimWorker) -> None:
        now, r = self.q.now, self.reqs[i]
        self.report.ttft_s[i] = now - r.arrival_s
        self._prefilled(i)
        full = w.engine.take_parked(str(i))
        w.finished += 1
        self.store.put(full)  # the router reads the store where it is
        address, tokens, _ = self.held.pop(i)
        self.router.release(address, tokens)
        if r.output_tokens <= 1:
            self._finish(i)
            return
        try:
            d_addr, d_tokens = self.router.pick(DECODE, r.prompt_tokens, r.output_tokens)
        except NoWorkerError:
            self.router.admission.release("")
            self._resolved(i, "failed: no decode worker")
            return
        self.held[i] = (d_addr, d_tokens, 0)
        self.report.decode_worker[i] = d_addr
        d = self.workers[d_addr]
        self.hashes[i] = full
        missing = -(-r.prompt_tokens // self.cfg.block_size) - d.engine.cached_blocks(full)
        d.inbound += 1
        self.counts["kv_transfers"] += 1
        self.counts["kv_bytes"] += missing * self.bpt
        self._send(self.links[d_addr], ("kv", i, d_addr), missing * self.bpt)

    def _finish(self, i: int) -> None:
        now, r = self.q.now, self.reqs[i]
        rep = self.report
        rep.end_s[i] = now
        held = self.held.pop(i, None)
        if held is not None:
            self.router.release(*held)
        self.router.admission.release("")
        self._prefilled(i)
        if self.connector is not None:
            ttft = rep.ttft_s[i]  # it made its first token before it ended
            self.connector.finished(now, now - r.arrival_s, ttft, r.prompt_tokens,
                                    r.output_tokens, i in self.offloaded, self.routes.get(i))
        self.offloaded.discard(i)
        self.hashes.pop(i, None)
        self.known.pop(i, None)
        self._resolved(i, OK)

    # ---- transfers -----------------------------------------------------------------------------
    def _send(self, link: Link, key, nbytes: int) -> None:
        work = self.profile.transfer_s(int(nbytes), self.cfg.transport) if nbytes > 0 else 0.0
        link.add(self.q.now, key, work)
        self._arm(link)

    def _arm(self, link: Link) -> None:
        at = link.next_done_s(self.q.now)
        if at is not None:
            self.q.push(at, "link", (link, link.version))

    def _link(self, payload) -> None:
        link, version = payload
        if version != link.version:
            return
        for kind, i, address in link.complete(self.q.now):
            w = self.workers[address]
            w.inbound -= 1
            if kind == "fetch":
                self._to_prefill(w, i)
            elif kind == "kv":
                self._join(w, lambda w=w, i=i: self._hand_over(w, i))
            else:
                self.moves.landed(kind, i, w)
        self._arm(link)

    def _hand_over(self, w: SimWorker, i: int) -> None:
        r = self.reqs[i]  # its KV named by the blocks the prefill worker put
        w.engine.add_prefilled(str(i), prompt_tokens_of(r.block_hashes, r.prompt_tokens, i + 1,
                                                        self.cfg.prefix_block_tokens),
                               self.hashes[i], r.output_tokens)

    # ---- workers -------------------------------------------------------------------------------
    def _join(self, w: SimWorker, join) -> None:
        """A request reaches a worker's engine between two steps (a run is cut short)."""
        w.joins.append(join)
        self._wake(w)

    def _wake(self, w: SimWorker) -> None:
        if w.state in (STARTING, SWITCHING):
            return
        if w.run is not None:
            end = w.cut_run(self.q.now)
            if end is not None:
                self.q.push(end, "step", (w.address, w.token))
        elif not w.busy:
            for enter in w.joins:
                enter()
            w.joins.clear()
            if w.address in self.moves.watch:
                self.moves.between_steps(w)
            host = self.host  # workers sharing CPU cores: the step is timed with the host's load
            end = w.start(self.q.now, self.profile if host is None else host.profile_for(w))
            if host is not None:  # w started or stopped computing: the others' steps re-timed
                for at, key in host.sync(self.q.now, w, self.workers):
                    self.q.push(at, "step", key)
            if end is not None:
                self.q.push(end, "step", (w.address, w.token))
            elif w.state == W_DRAINING and w.drained():
                self._switch(w)

    def _step(self, payload) -> None:
        address, token = payload
        w = self.workers[address]
        if token != w.token:
            return
        events, _ = w.finish_step()
        for rid, kind in events:
            i = int(rid)
            if kind == "parked":
                self._first_token(i, w)
            elif kind == "first":
                self.report.ttft_s[i] = self.q.now - self.arrivals[i]
                self._prefilled(i)
            else:
                w.finished += 1
                self._finish(i)
        if address in self.moves.awaiting:
            self.moves.stepped(w)
        if self.router.kv_aware:
            changes = w.engine.block_events()
            if changes:
                self.router.worker_events(address, changes)
        self._wake(w)

    # ---- polls, the controller and flips -------------------------------------------------------
    def _poll(self, _=None) -> None:
        now = self.q.now
        for a, w in self.workers.items():
            if w.state != STARTING:
                self.router.report(a, w.role, w.stats(), now)
        if (self.arrived == len(self.arrivals) and now - self.last_work_s > STALL_S
                and not any(w.busy for w in self.workers.values())):
            self.stalled = True  # e.g. a worker whose waiting requests hold the blocks it needs
        self.q.push(now + self.cfg.stats_interval_s, "poll")

    def _tick(self, _=None) -> None:
        assert self.ctl is not None  # ticks are scheduled only with a controller
        self.ctl.tick()  # the live controller's tick, through `control.SimConnector`
        self.q.push(self.q.now + self.cfg.tick_s, "tick")

    # ---- what the controller's connector does here -------------------------------------------
    def switching(self) -> dict[str, str]:
        return {a: w.to_role for a, w in self.workers.items()
                if w.state in (W_DRAINING, SWITCHING) and w.to_role}

    def begin_flip(self, address: str, to_role: str, drain_timeout_s: float, done,
                   migrate: bool = False) -> None:
        """Drain `address` for a switch to `to_role` (`_switched` or `_drain_deadline` ends
        it and calls `done(outcome)`); nothing when it is not serving in the other role.
        `migrate`: a decode worker's running requests move to other decode workers."""
        w, now = self.workers[address], self.q.now
        if w.state != SERVING or w.role == to_role:
            return
        if migrate:
            self.moves.drain(w)
        w.state, w.to_role, w.drain_started_s = W_DRAINING, to_role, now
        self._flips[address] = (done, w.role, now)
        self.router.set_state(w.address, DRAINING, None, f"switching to {to_role}", now)
        self.q.push(now + drain_timeout_s, "drain_deadline", (w.address, now))
        self._roles()
        self._wake(w)

    def migrate(self, address: str, count: int, reason: str, done) -> None:
        """Move `count` running decodes off `address`, keeping its role (`Migrations.balance`)."""
        self.moves.balance(address, count, reason, done)

    def readmit(self, address: str, reason: str) -> str | None:
        """A worker whose flip failed back into its role's pool, as the live `Flipper` does."""
        w = self.workers[address]
        if w.state != SERVING:
            return None
        self.failed.discard(address)
        self.router.set_state(address, ACTIVE, w.role, reason, self.q.now)
        self._roles()
        self._wake(w)
        return w.role

    def _drain_deadline(self, payload) -> None:
        """A flip still draining at its deadline fails, as the live `Flipper`'s does: the
        worker keeps its role and what it holds, out of both pools until re-admitted."""
        address, started = payload
        w, now = self.workers[address], self.q.now
        if w.state != W_DRAINING or w.drain_started_s != started:
            return  # it switched meanwhile
        to_role, (done, from_role, _) = w.to_role, self._flips.pop(address)
        moved = self.moves.drained(address)  # a round under way ends; no new one starts
        w.state, w.to_role = SERVING, None
        self.counts["failed_flips"] += 1
        self.counts["drain_s"] += now - started
        self.failed.add(address)
        self.router.set_state(address, FAILED, None, "flip failed: drain_timeout_s", now)
        self._roles()
        self._wake(w)
        done(FlipOutcome(address, from_role, to_role or "?", False, now - started,
                         "drain_timeout_s", moved_requests=moved))

    def _switch(self, w: SimWorker) -> None:
        now = self.q.now
        w.state = SWITCHING
        self.counts["drain_s"] += now - w.drain_started_s
        self.counts["switch_s"] += self.profile.flip_s
        self.q.push(now + self.profile.flip_s, "switched", w.address)

    def _switched(self, address: str) -> None:
        w, now = self.workers[address], self.q.now
        assert w.to_role is not None  # a switch starts with its target role
        w.role, w.state, w.to_role = w.to_role, SERVING, None
        w.switches += 1
        self.counts["flips"] += 1
        self.router.set_state(address, ACTIVE, w.role, f"switched to {w.role}", now)
        self._feed(w)
        self._roles()
        self._wake(w)
        done, from_role, started = self._flips.pop(address)
        done(FlipOutcome(address, from_role, w.role, True, now - started,
                         moved_requests=self.moves.drained(address)))

    def _feed(self, w: SimWorker) -> None:
        """The index follows `w`'s prefix cache while it prefills: from a snapshot when it
        turns prefill (as a router resyncs), and not at all while it decodes; the decode
        workers' count of holders per block counts its cache while it decodes."""
        recorder, held = w.engine.recorder, self._decode_held
        counted = w.role == DECODE and self.cfg.max_local_prefill_tokens > 0
        if counted != (recorder.holders is not None):
            for h in w.engine.pool.by_hash:
                left = held.get(h, 0) + (1 if counted else -1)
                if left:
                    held[h] = left
                else:
                    del held[h]
            recorder.holders = held if counted else None
        if self.router.kv_aware:
            w.engine.recorder.keep = w.role == PREFILL
            w.engine.block_events()  # changes already in the snapshot, or not followed
            self.router.resync(w.address, w.engine.pool.cached_hashes()
                               if w.role == PREFILL else [])

    def _ready(self, address: str) -> None:
        w = self.workers[address]
        w.state = SERVING
        self.router.set_state(address, ACTIVE, w.role, "started", self.q.now)
        self._roles()
        self._wake(w)

    def _roles(self) -> None:
        p = d = moving = 0
        for a, w in self.workers.items():
            if w.state == SERVING and a not in self.failed:
                p += w.role == PREFILL
                d += w.role == DECODE
            elif w.state in (W_DRAINING, SWITCHING):
                moving += 1
        entry = (self.q.now, p, d, moving)
        if self.report.roles and self.report.roles[-1][0] == self.q.now:
            self.report.roles[-1] = entry
        else:
            self.report.roles.append(entry)
