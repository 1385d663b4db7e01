"""The router's workers: membership applied to channels, polls and routing choices.

Owns a channel and stub per known worker (made when it joins, closed when it is forgotten),
the `Membership` table behind one lock, the stats poller (one thread running an event loop:
GetStats to every member each `stats_interval_s`, all at once, over channels of its own; an
answer is a `report` in the role it names, no answer is a `missed` poll), a call with no first
answer in time (`first_answer_s`, `_stalled`), the KV event feeds following membership, and for
admission, the prefill pool's measured rate (`prefill_rate`, from each prefill member's polled
counters) and how much of a prompt is cached already (`cached_prefix_tokens`). The routing
choices on this state (`pick()`, `take_offload()`, `take_cached_local()`, the other
`route.Workers` choices) are its mixin `picks.Picks`.

Must not score workers or decide transitions itself: `membership.py` and (through `picks.py`)
`policy.py` and `deflect.py` do, as pure functions of their inputs; this module only feeds them
and carries out the result.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.core.rates import RateMeter
from pdserve.router.deflect import HANDOFF_S
from pdserve.router.kv_feed import KvFeeds
from pdserve.core.roles import DECODE, GONE, PREFILL
from pdserve.router.membership import (
    Health, Member, Membership, UnknownMemberError, reports_draining,
)
from pdserve.router.picks import Picks
from pdserve.router.policy import RouteDecision
from pdserve.router.worker_calls import WorkerCalls, first_answer_deadline
from pdserve.wire import role_from_proto

log = logging.getLogger(__name__)

# A poll that gets one of these did not reach the worker: it counts as missed. Any other
# answer (even an error) came from a live process.
_MISSED_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
# A worker answers GetStats between engine steps, and one CPU prefill step can take seconds: a
# short timeout would call a busy worker gone. A dead process is refused at once regardless.
_POLL_TIMEOUT_S = 5.0


class WorkerSet(Picks):
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
