"""The router's workers: membership applied to channels, polls and routing choices.

Owns a channel and stub per known worker (made when it joins, closed when it is forgotten),
the `Membership` table behind one lock, the stats poller (one thread running an event loop:
GetStats to every member each `stats_interval_s`, all at once, over channels of its own; an
answer is a `report` in the role it names, no answer is a `missed` poll), the KV event feeds
following membership, and `pick()`: build the policy's `RouteInput` from the ACTIVE members of
a role (the prompt's chained block hashes looked up in the block index for KV-aware prefill),
ask the policy, and count the choice in flight for the request's duration. Also
`take_offload()`, the same for a prefill offloaded onto a decode worker when the deflection
(`deflect.py`) finds it faster than the prefill pool's pick, and `take_cached_local()`, for a
prompt a decode worker caches all but a short tail of; and for admission, the prefill pool's
measured rate (`prefill_rate`, from each prefill member's polled counters) and how much of a
prompt is cached already (`cached_prefix_tokens`).

Must not score workers or decide transitions itself: `policy.py`, `deflect.py` and
`membership.py` do, as pure functions of their inputs; this module only feeds them and carries
out the result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from typing import Any

import grpc

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.core.block_hash import prompt_block_hashes
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.core.rates import RateMeter
from pdserve.router.deflect import (HANDOFF_S, Deflection, deflect, pool_side,
                                    request_cost_tokens)
from pdserve.router.kv_feed import KvFeeds
from pdserve.router.local_prefill import LocalCandidate, choose_cached_local
from pdserve.core.roles import DECODE, GONE, PREFILL
from pdserve.router.membership import (
    ACTIVE, Health, Member, Membership, UnknownMemberError, reports_draining,
)
from pdserve.router.policy import (
    KvAware, NoWorkerError, RouteDecision, RouteInput, WorkerLoad,
)
from pdserve.router.worker_calls import WorkerCalls, first_answer_deadline
from pdserve.wire import role_from_proto

log = logging.getLogger(__name__)

# A poll that gets one of these did not reach the worker: it counts as missed. Any other
# answer (even an error) came from a live process.
_MISSED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A worker answers GetStats between engine steps, and one CPU prefill step can take seconds: a
# short timeout would call a busy worker gone. A dead process is refused at once regardless.
_POLL_TIMEOUT_S = 5.0


@dataclasses.dataclass(frozen=True)
class LiveRequest:
    """What the route's choices need of a request (`route.Workers`): its prompt, its tenant's
    salt, and the tokens it may add (max_tokens: a decode worker's KV must fit them)."""

    prompt_ids: Sequence[int]
    salt: str = ""
    extra_tokens: int = 0


class WorkerSet:
    """Every worker the router knows, both pools. Thread-safe."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *, prefill_policy,
                 decode_policy, block_size_tokens: int = 16, feeds: KvFeeds | None = None,
                 stats_interval_s: float = 1.0, max_missed: int = 3,
                 forget_after_s: float = 300.0, first_answer_min_s: float = 0.0,
                 handoff_s: float = HANDOFF_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.membership = Membership(max_missed, forget_after_s)
        self.rates = RateMeter()  # measured prefill rates per member
        # Calls in flight, ended when their worker is gone or gives no first answer in time.
        self.calls = WorkerCalls(on_stall=self._stalled)
        self.first_answer_min_s = first_answer_min_s
        self.handoff_s = handoff_s  # a prefill call's fixed cost, for the deflection's estimate
        self.policies = {PREFILL: prefill_policy, DECODE: decode_policy}
        self.block_size_tokens = block_size_tokens
        self.feeds = feeds
        self.stats_interval_s = stats_interval_s
        self.clock = clock
        self.last_decision: RouteDecision | None = None
        self.on_change: Callable[[bool], None] | None = None  # see watch()
        self._lock = threading.RLock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, wpb_grpc.WorkerStub] = {}
        # Bumped when a member's channel is made anew: the poller's own channel follows.
        self._generation: dict[str, int] = {}
        self._serving: bool | None = None
        self._notify_lock = threading.Lock()
        self._stop = threading.Event()
        now = clock()
        for role, addresses in ((PREFILL, prefill), (DECODE, decode)):
            for a in addresses:
                self.join(a, role, now=now)
        self._poller: threading.Thread | None = None
        if stats_interval_s > 0:
            self._poller = threading.Thread(target=self._poll_loop, name="worker-stats",
                                            daemon=True)
            self._poller.start()

    # ---- membership, carried out ---------------------------------------------------------------
    def join(self, address: str, role: str, now: float | None = None) -> Member:
        """A worker joins (or rejoins) in `role`; a snapshot of its member."""
        with self._lock:
            was = self.membership.get(address).state if address in self.membership else None
            m = self.membership.join(address, role, self.clock() if now is None else now)
            if was is None or was == GONE:
                # A fresh channel: one to a worker that was gone may sit in gRPC's reconnect
                # backoff (growing to minutes) long after the worker says it is back.
                self._open(address)
            snap = dataclasses.replace(m)
        self._changed()
        return snap

    def report(self, address: str, stats: wpb.WorkerStats, now: float | None = None,
               asked_s: float | None = None) -> Member | None:
        """A poll answer (or a registration's GetStats) from `address`, asked at `asked_s`."""
        role = role_from_proto(stats.role)
        if role is None:  # workers always host a role; an answer without one changes nothing
            log.warning("worker %s reported no role", address)
            return None
        with self._lock:
            before = self.membership.get(address) if address in self.membership else None
            was = None if before is None else (before.state, before.role)
            m = self.membership.report(address, role, self.clock() if now is None else now, stats,
                                       asked_s)
            snap = None if m is None else dataclasses.replace(m)
            if snap is not None and role == PREFILL:
                self.rates.observe(address, stats.prompt_tokens_computed, stats.busy_seconds)
            else:  # a decode worker's busy time is mostly decoding: not a prefill rate
                self.rates.forget(address)
        if snap is not None and was != (snap.state, snap.role):
            log.warning("worker %s is %s in the %s role: %s", address, snap.state, snap.role,
                        snap.reason)
        self._changed()
        return snap

    def set_state(self, address: str, state: str, role: str | None = None,
                  reason: str = "") -> Member:
        """The controller moves a member (GONE forgets it at once); a snapshot of it.
        Raises UnknownMemberError."""
        with self._lock:
            m = dataclasses.replace(self.membership.set_state(address, state, role, reason,
                                                              now=self.clock()))
            if state == GONE:
                self._forget([address])
        log.info("worker %s set %s in the %s role: %s", address, m.state, m.role, m.reason)
        self._changed()
        return m

    def set_offload_budgets(self, budgets: dict[str, tuple]) -> None:
        """Replaces every offload budget: address -> (max tokens, chunk tokens[, step_s])
        (membership.InvalidBudgetError on a bad one)."""
        with self._lock:
            self.membership.set_offload_budgets(budgets)

    def members(self) -> list[Member]:
        """Snapshots of every member, by address."""
        with self._lock:
            return [dataclasses.replace(m) for m in self.membership.members()]

    def get(self, address: str) -> Member:
        with self._lock:
            return dataclasses.replace(self.membership.get(address))

    def serving(self) -> bool:
        with self._lock:
            return self.membership.serving()

    def health(self) -> Health:
        with self._lock:
            return self.membership.health()

    def prefill_rate(self, peak: bool = False) -> float | None:
        """The prefill pool's measured prompt tokens per second, smoothed or (`peak`) the best
        each member has shown (None: nothing measured)."""
        with self._lock:
            return self.rates.pool_rate((m.address for m in self.membership.pool(PREFILL)
                                         if not reports_draining(m)), peak=peak)

    def cached_prefix_tokens(self, prompt_ids: Sequence[int], salt: str = "") -> int:
        """Prompt tokens some prefill worker or the store already caches (0 without a KV
        index): the most any prefill choice could skip."""
        with self._lock:
            addresses = [m.address for m in self.membership.pool(PREFILL)]
        local, store = self._prefix(addresses, prompt_ids, salt)
        return max([store, *local]) * self.block_size_tokens

    def stub(self, address: str) -> wpb_grpc.WorkerStub:
        with self._lock:
            s = self._stubs.get(address)
        if s is None:
            raise UnknownMemberError(f"no worker {address!r} is known to this router")
        return s

    def _open(self, address: str) -> None:
        old = self._channels.pop(address, None)
        if old is not None:
            self.calls.end(address, "came back on a new connection")
            old.close()
        self._channels[address] = ch = rpc.make_channel(address, WORKER)
        self._stubs[address] = wpb_grpc.WorkerStub(ch)
        self._generation[address] = self._generation.get(address, 0) + 1
        if self.feeds is not None:
            self.feeds.add(address)

    def _forget(self, addresses: Iterable[str]) -> None:
        for a in addresses:
            self.membership.forget(a)
            self.rates.forget(a)
            self._stubs.pop(a, None)
            self._generation.pop(a, None)
            ch = self._channels.pop(a, None)
            if ch is not None:
                ch.close()
            if self.feeds is not None:
                self.feeds.remove(a)
            log.warning("worker %s forgotten", a)

    def watch(self, on_change: Callable[[bool], None]) -> None:
        """Call `on_change(serving)` now and whenever serving() flips (health status)."""
        with self._notify_lock:
            self.on_change = on_change
            self._serving = self.serving()
            on_change(self._serving)

    def _changed(self) -> None:
        """Tell on_change when serving() flips. Its own lock keeps the calls in the order of
        the states they report; the table's lock is not held while it runs."""
        with self._notify_lock:
            serving = self.serving()
            if serving == self._serving:
                return
            self._serving = serving
            if self.on_change is not None:
                self.on_change(serving)

    # ---- choices -------------------------------------------------------------------------------
    def _prefix(self, addresses: list[str], prompt_ids: Sequence[int] | None, salt: str
                ) -> tuple[list[int], int]:
        """(leading blocks of this prompt cached per worker, leading blocks in the store)."""
        if self.feeds is None or not isinstance(self.policies[PREFILL], KvAware) or not prompt_ids:
            return [0] * len(addresses), 0
        return self._overlaps(addresses, prompt_ids, salt)

    def _overlaps(self, addresses: list[str], prompt_ids: Sequence[int], salt: str
                  ) -> tuple[list[int], int]:
        """The index's answer for this prompt (hashing a long one takes time: not under the
        lock). The engine reuses whole blocks of all prompt tokens but the last (same hashes as
        the prefill role's store lookup and the scheduler's prefix match)."""
        hashes = prompt_block_hashes(list(prompt_ids[:-1]), self.block_size_tokens, salt)
        return self.feeds.overlaps(hashes, self.block_size_tokens, addresses)

    def _input(self, pool: list[Member], local: dict[str, int], store: int, prompt_tokens: int,
               extra_tokens: int) -> RouteInput:
        workers = []
        for m in pool:
            s = m.stats
            workers.append(WorkerLoad(
                m.address, m.in_flight, True, m.in_flight_tokens, local.get(m.address, 0),
                free_blocks=None if s is None else s.num_free_blocks,
                running=0 if s is None else s.num_running, waiting=0 if s is None else s.num_waiting))
        need = -(-(prompt_tokens + extra_tokens) // self.block_size_tokens)
        return RouteInput(tuple(workers), prompt_tokens, self.block_size_tokens, store, need)

    @contextmanager
    def pick(self, role: str, prompt_ids: Sequence[int] | None = None, salt: str = "",
             extra_tokens: int = 0, exclude: frozenset[str] = frozenset()):
        """Choose an ACTIVE worker of `role` (not in `exclude`) for one request; yields
        (address, stub) and counts the request in flight until the block exits.
        `extra_tokens`: tokens the request may add (max_tokens), for decode's KV fit.
        Raises NoWorkerError when no such worker is ACTIVE."""
        address, taken = self._take(role, prompt_ids, salt, extra_tokens, exclude)
        try:
            yield address, self._stubs[address]
        finally:
            self.release_taken(address, taken)

    def _take(self, role: str, prompt_ids: Sequence[int] | None, salt: str, extra_tokens: int,
              exclude: frozenset[str], count: bool = True) -> tuple[str, tuple[float, int]]:
        """`pick`'s choice, counted in flight unless not `count`: (address, taken);
        NoWorkerError."""
        if role == PREFILL:
            with self._lock:
                addresses = [m.address for m in self.membership.pool(role)
                             if m.address not in exclude]
            # Outside the lock: hashing a long prompt takes time.
            cached, store = self._prefix(addresses, prompt_ids, salt)
            local = dict(zip(addresses, cached))
        else:
            local, store = {}, 0
        with self._lock:
            pool = [m for m in self.membership.pool(role) if m.address not in exclude]
            if not pool:
                raise NoWorkerError(f"no active {role} worker"
                                    + (f" besides {sorted(exclude)}" if exclude else ""))
            inp = self._input(pool, local, store, len(prompt_ids or ()), extra_tokens)
            d = self.policies[role].decide(inp)
            address = pool[d.index].address
            tokens = d.work_tokens if d.work_tokens is not None else inp.prompt_tokens
            if count:
                self.membership.acquire(address, tokens)
            self.last_decision = d
        if d.scores:
            log.debug("routed to %s: %s", address, d.scores)
        return address, (tokens, 0)

    # ---- route.Workers: the choices of a request's route, each released with release_taken --
    def choose_prefill(self, request: LiveRequest) -> tuple[str, tuple[float, int]] | None:
        """The prefill worker `take_prefill` would take for `request`, not counted: (address,
        what taking it counts); None when none is ACTIVE."""
        try:
            return self._take(PREFILL, request.prompt_ids, request.salt, 0, frozenset(), False)
        except NoWorkerError:
            return None

    def take_prefill(self, request: LiveRequest, exclude: frozenset[str],
                     chosen: tuple[str, tuple[float, int]] | None = None
                     ) -> tuple[str, tuple[float, int]] | None:
        """A prefill worker for `request` (not in `exclude`), counted in flight: `chosen`
        (`choose_prefill`'s answer) while it is still ACTIVE, else the policy's choice; None
        when none is ACTIVE."""
        if chosen is not None:
            with self._lock:
                address = chosen[0]
                m = self.membership.get(address) if address in self.membership else None
                if (m is not None and m.state == ACTIVE and m.role == PREFILL
                        and address not in exclude):
                    self.membership.acquire(address, chosen[1][0])
                    return chosen
        try:
            return self._take(PREFILL, request.prompt_ids, request.salt, 0, exclude)
        except NoWorkerError:
            return None

    def take_offload(self, request: LiveRequest, prefill: tuple[str, tuple[float, int]] | None
                     ) -> tuple[tuple[str, tuple[float, int], int] | None, Deflection | None]:
        """A decode worker to prefill this prompt itself within its offload budget, when it
        gives a lower estimated TTFT than `prefill`, the prefill pool's pick (`route.Workers`;
        `deflect.deflect`): ((address, taken, chunk tokens) with the prompt counted against
        the budget, or None: the pick stands; the deflection, None when no budget fits)."""
        prompt_tokens = len(request.prompt_ids)
        with self._lock:
            candidates = self.membership.offload_candidates()
            if not candidates:
                return None, None
            # A pick forgotten since (gone): no prefill worker to weigh.
            gone = prefill is None or prefill[0] not in self.membership
            tokens, rate = pool_side(
                None if gone else self.membership.get(prefill[0]),
                0.0 if prefill is None else prefill[1][0],
                request_cost_tokens(self.policies[PREFILL]), self.rates,
                (m.address for m in self.membership.pool(PREFILL) if not reports_draining(m)))
            d = deflect(candidates, prompt_tokens, tokens, rate, self.handoff_s)
            if d is None or d.index is None:
                return None, d
            m = candidates[d.index]
            self.membership.acquire(m.address, 0.0, prompt_tokens)
            return (m.address, (0.0, prompt_tokens), m.offload_chunk), d

    def take_cached_local(self, request: LiveRequest, max_uncached_tokens: int
                          ) -> tuple[str, tuple[float, int], int] | None:
        """A decode worker whose prefix cache holds all but at most `max_uncached_tokens` of
        this prompt, to prefill the rest itself (`local_prefill.choose_cached_local`):
        (address, taken, tokens it caches), counted in flight; None (no KV index, or no worker
        qualifies)."""
        prompt_ids = request.prompt_ids
        if self.feeds is None or max_uncached_tokens <= 0 or not prompt_ids:
            return None
        with self._lock:
            addresses = [m.address for m in self.membership.pool(DECODE)]
        if not addresses:
            return None
        cached, _ = self._overlaps(addresses, prompt_ids, request.salt)  # outside the lock
        blocks = dict(zip(addresses, cached))
        need = -(-(len(prompt_ids) + request.extra_tokens) // self.block_size_tokens)
        with self._lock:
            pool = self.membership.pool(DECODE)
            candidates = [LocalCandidate(
                m.address, blocks.get(m.address, 0) * self.block_size_tokens,
                running=0 if m.stats is None else m.stats.num_running,
                waiting=0 if m.stats is None else m.stats.num_waiting,
                free_blocks=None if m.stats is None else m.stats.num_free_blocks)
                for m in pool]
            c = choose_cached_local(candidates, len(prompt_ids), max_uncached_tokens, need)
            if c is None:
                return None
            address = candidates[c.index].address
            self.membership.acquire(address, c.uncached_tokens)
            return address, (float(c.uncached_tokens), 0), c.cached_tokens

    def release_taken(self, address: str, taken: tuple[float, int]) -> None:
        """Stop counting what a `take_*` or `pick` counted on `address`."""
        with self._lock:
            self.membership.release(address, taken[0], taken[1])

    # ---- the poller ----------------------------------------------------------------------------
    # One asyncio loop in one thread asks every member: a poll costs one task per member, not
    # a thread (the synchronous API keeps a polling thread per channel with a call in flight).
    # A round waits for the answers at most one interval: a member that does not answer (a
    # paused process waits out the poll's timeout) keeps its poll pending into later rounds,
    # while every other member's stats stay as fresh as the interval.
    async def _poll_once(self, channels: dict[str, tuple[int, Any]],
                         pending: dict[str, tuple[float, asyncio.Task]]) -> None:
        """GetStats to every member without a poll pending; apply the answers and misses that
        came within the interval; forget the long gone. `channels`: the poller's own
        (generation, aio channel) per member, kept in step; `pending`: its polls in flight
        (asked at, task) per member."""
        with self._lock:
            wanted = dict(self._generation)
        for a in [a for a, (g, _) in channels.items() if wanted.get(a) != g]:
            await channels.pop(a)[1].close()
            asked = pending.pop(a, None)
            if asked is not None:
                asked[1].cancel()
        for a, g in wanted.items():
            if a not in channels:
                channels[a] = (g, rpc.make_aio_channel(a, WORKER))
        timeout = max(_POLL_TIMEOUT_S, 2 * self.stats_interval_s)
        now = self.clock()
        for a, (_, ch) in channels.items():
            if a not in pending:
                pending[a] = (now, asyncio.ensure_future(wpb_grpc.WorkerStub(ch).GetStats(
                    wpb.GetStatsRequest(), timeout=timeout)))
        if pending:
            await asyncio.wait([t for _, t in pending.values()], timeout=self.stats_interval_s)
        for a in [a for a, (_, t) in pending.items() if t.done()]:
            asked, task = pending.pop(a)
            if task.cancelled():
                continue
            e = task.exception()
            if e is None:
                self.report(a, task.result(), asked_s=asked)
            elif isinstance(e, grpc.RpcError) and e.code() in _MISSED_CODES:
                self._missed(a)
            else:
                log.warning("stats of %s: %s", a, f"{e.code()} {e.details()}"
                            if isinstance(e, grpc.RpcError) else repr(e))
        with self._lock:
            self._forget(self.membership.forget_gone(self.clock()))
        self._changed()

    def first_answer_s(self, address: str) -> float | None:
        """How long a prefill call to `address` may wait for its answer (None: no deadline):
        the prefill work the router has sent it at its measured rate, times a factor, at least
        `first_answer_min_s`. (A decode hop has none: a busy decode worker's queue is not the
        router's to predict, and its polls tell a stalled one.)"""
        with self._lock:
            if address not in self.membership:
                return None
            m = self.membership.get(address)
            rate = self.rates.rate(address)
            work = max(m.in_flight_tokens, 1.0)
        return first_answer_deadline(work, rate, self.first_answer_min_s)

    def _stalled(self, address: str, why: str, after_s: float) -> None:
        """A call to `address` got no first answer in time: out of the pools as if dead, its
        other calls re-routed; its polls bring it back after as long again."""
        with self._lock:
            m = self.membership.stalled(address, why, self.clock(), after_s)
            newly = m is not None and m.state == GONE and m.reason == why
        if newly:
            ended = self.calls.end(address, why)
            log.warning("worker %s %s: out of the pools for %gs at least; %d other calls to "
                        "it re-routed", address, why, after_s, ended)
        self._changed()

    def _missed(self, address: str) -> None:
        with self._lock:
            m = self.membership.missed(address, self.clock())
            newly_gone = (m is not None and m.state == GONE
                          and m.missed == self.membership.max_missed)
        if newly_gone:
            ended = self.calls.end(address, f"stopped answering ({m.reason})")
            log.warning("worker %s is gone: %s; %d calls to it re-routed", address, m.reason,
                        ended)

    def _poll_loop(self) -> None:
        asyncio.run(self._poll_forever())

    async def _poll_forever(self) -> None:
        channels: dict[str, tuple[int, Any]] = {}
        pending: dict[str, tuple[float, asyncio.Task]] = {}
        try:
            while not self._stop.is_set():
                await asyncio.sleep(self.stats_interval_s)
                if self._stop.is_set():
                    break
                try:
                    await self._poll_once(channels, pending)
                except Exception:  # the poller must outlive any one bad poll
                    log.exception("stats poll failed")
        finally:
            for _, task in pending.values():
                task.cancel()
            for _, ch in channels.values():
                await ch.close()

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        if self.feeds is not None:
            self.feeds.close()
        with self._lock:
            for ch in self._channels.values():
                ch.close()
            self._channels.clear()
            self._stubs.clear()
