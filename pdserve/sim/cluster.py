"""The simulated cluster: requests, workers, links, the store, the router and the controller
joined on one event queue.

Owns the event loop and what happens at each event: an arrival (through `arrival.Arrivals`:
admission, the route, the store fetch), a worker's step ending (first tokens, the KV put into
the store and its hand-off to a decode worker, ends), a transfer landing, a stats poll, a
controller tick and what its connector asks (flips through `flips.Flips`: drain, then the
profile's switch time; running decodes moved with their KV through `migration.Migrations`), and
the per-request records. Must not score, admit, schedule or decide itself: the real cores do
(through `router.SimRouter`, `engine_model.EngineModel` and the live controller through
`control.SimConnector`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.core.roles import DECODE, DRAINING, PREFILL, SERVING, STARTING, SWITCHING
from pdserve.core.roles import DRAINING as W_DRAINING
from pdserve.controller.signals import Slo
from pdserve.router.admission import Ticket
from pdserve.router.policy import NoWorkerError
from pdserve.router.retry import RetryPolicy
from pdserve.sim.arrival import Arrivals
from pdserve.sim.config import SimConfig
from pdserve.sim.control import SimConnector, controller
from pdserve.sim.engine_model import EngineModel
from pdserve.sim.events import EventQueue
from pdserve.sim.flips import Flips
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
        # `Arrivals._decode_cached` need not ask every decode cache about it.
        self._decode_held: dict[bytes, int] = {}
        self.router = SimRouter(cfg, {f"w{i:0{width}d}": r for i, r in enumerate(roles)},
                                store=self.store)
        # The KV index follows the prefix caches of prefill workers, the only ones it is asked
        # about for routing (a worker turning prefill is resynced from its cache: `Flips.feed`);
        # for conditional disaggregation, decode workers' caches are read where they are, the
        # answer the index would give (`Arrivals._decode_cached`).
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
        self.arriving = Arrivals(self)  # each request up to its entry into an engine
        self.unresolved = n
        self.arrived = 0
        self.last_work_s = 0.0
        self.stalled = False  # no step, transfer or arrival for STALL_S with requests left
        self.flips = Flips(self)  # the flips under way and the workers whose flip failed
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
        self.flips.roles()
        handlers: dict[str, Callable[[Any], None]] = {
            "arrive": self.arriving.arrive, "step": self._step, "link": self._link,
            "poll": self._poll, "tick": self._tick, "switched": self.flips.switched,
            "ready": self.flips.ready, "drain_deadline": self.flips.drain_deadline}
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
                self.arriving.to_prefill(w, i)
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
                self.flips.switch(w)

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

    # ---- polls and the controller --------------------------------------------------------------
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

    # ---- what the controller's connector does here (`flips.Flips`, `migration.Migrations`) ---
    def switching(self) -> dict[str, str]:
        return self.flips.switching()

    def begin_flip(self, address: str, to_role: str, drain_timeout_s: float, done,
                   migrate: bool = False) -> None:
        """Drain `address` for a switch to `to_role` (`Flips.begin_flip`)."""
        self.flips.begin_flip(address, to_role, drain_timeout_s, done, migrate)

    def migrate(self, address: str, count: int, reason: str, done) -> None:
        """Move `count` running decodes off `address`, keeping its role (`Migrations.balance`)."""
        self.moves.balance(address, count, reason, done)

    def readmit(self, address: str, reason: str) -> str | None:
        """A worker whose flip failed back into its role's pool (`Flips.readmit`)."""
        return self.flips.readmit(address, reason)
