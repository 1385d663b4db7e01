"""Keeps the router's block index (`KvIndex`) current from the cluster's event streams.

Owns one daemon thread per known worker (started when it joins, stopped when it is forgotten),
subscribed to its `WatchKvEvents` (a snapshot of the worker's prefix cache, then its changes),
and one for the store master's `WatchEvents` (objects stored, evicted, removed; keys mapped
back to block hashes with `parse_key`). Each thread reconnects after an error; a snapshot, a
reconnect to the store or lost store events reset what the index knows of that source first.
The index is read under the same lock (`overlaps`). Must not choose workers: that is the
policy's job (`policy.py`).

Staleness is allowed by design: between an eviction and its event the index claims a block that
is gone, and the worker simply computes it. Routing gets less good, never wrong.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve import rpc
from pdserve.core.identity import MASTER, WORKER
from pdserve.kvstore.client import Plane, parse_key
from pdserve.proto import kvmaster_pb2 as mpb
from pdserve.proto import kvmaster_pb2_grpc as mpb_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.router.kv_index import CLEARED, REMOVED, STORED, KvEvent, KvIndex, store_source

log = logging.getLogger(__name__)

_WORKER_KINDS = {wpb.KV_EVENT_KIND_STORED: STORED, wpb.KV_EVENT_KIND_REMOVED: REMOVED}
_STORE_KINDS = {"stored": STORED, "evicted": REMOVED, "removed": REMOVED}
_LOG_STARTS = re.compile(r"starts at seq (\d+)")


def worker_batch_events(source: str, batch) -> list[KvEvent]:
    """Index events of one `KvEventBatch`: runs of equal kind become one event, in order."""
    out: list[KvEvent] = [KvEvent(source, CLEARED)] if batch.snapshot else []
    kind, run = None, []
    for e in batch.events:
        k = _WORKER_KINDS.get(e.kind)
        if k is None:
            continue
        if k != kind and run:
            out.append(KvEvent(source, kind, tuple(run)))
            run = []
        kind = k
        run.append(bytes(e.block_hash))
    if run:
        out.append(KvEvent(source, kind, tuple(run)))
    return out


def store_event(kind: str, key: str) -> KvEvent | None:
    """The index event of one store event, or None (not a whole-block object, or a kind that
    leaves the object in the store: a replica dropped, a demotion to SSD)."""
    k = _STORE_KINDS.get(kind)
    if k is None:
        return None
    try:
        bk = parse_key(key)
    except ValueError:
        return None
    if bk.plane is not Plane.FULL or bk.layer_start != 0:
        return None
    return KvEvent(store_source(bk.model_id), k, (bk.block_hash,))


def resume_after(details: str) -> int | None:
    """The seq to resume the store's event stream after, from the master's EventsLost error
    ("... the log starts at seq N": everything from N on is still there), or None."""
    m = _LOG_STARTS.search(details or "")
    return int(m.group(1)) - 1 if m else None


@dataclass
class _WorkerFeed:
    """One worker's event stream: the event that stops its thread."""

    stop: threading.Event = field(default_factory=threading.Event)


class KvFeeds:
    """The index's feeds. Workers come and go with membership (`add`, `remove`); a worker's
    cache is indexed whatever role it hosts, so one that switches into the prefill pool is
    routed to by what it already caches."""

    def __init__(self, worker_addresses: Sequence[str] = (), store_address: str = "",
                 index: KvIndex | None = None, retry_s: float = 1.0,
                 on_lag: Callable[[float], None] | None = None) -> None:
        self.store_addresses = [a for a in store_address.split(",") if a]
        self.index = index if index is not None else KvIndex()
        self.retry_s = retry_s
        # Called with each worker batch's lag: from the worker seeing its first event to the
        # index holding it (worker clock vs this one: across hosts it includes their offset).
        self.on_lag = on_lag
        self.lock = threading.Lock()
        self.model_ids: dict[str, str] = {}  # worker address -> model id it reported
        self.block_sizes: dict[str, int] = {}  # worker address -> block size it reported
        self.snapshots = 0  # worker snapshots applied (first subscription, resyncs)
        self.store_resets = 0
        self._stop = threading.Event()
        self._started = False
        self._calls: dict = {}  # streaming call -> the worker feed it serves (None: the store's)
        self._threads: list[threading.Thread] = []
        self._feeds: dict[str, _WorkerFeed] = {a: _WorkerFeed() for a in worker_addresses}

    @property
    def workers(self) -> list[str]:
        """Workers fed now, in the order they were added."""
        with self.lock:
            return list(self._feeds)

    def start(self) -> "KvFeeds":
        with self.lock:
            self._started = True
            feeds = list(self._feeds.items())
        for a, f in feeds:
            self._start_worker(a, f)
        if self.store_addresses:
            self._spawn("kv-feed-store", self._watch_store)
        return self

    def add(self, address: str) -> None:
        """Follow `address`'s prefix cache (a worker joined); a no-op if already followed."""
        with self.lock:
            if address in self._feeds or self._stop.is_set():
                return
            f = self._feeds[address] = _WorkerFeed()
            started = self._started
        if started:
            self._start_worker(address, f)

    def remove(self, address: str) -> None:
        """Stop following `address` (it was forgotten) and forget what it cached."""
        with self.lock:
            f = self._feeds.pop(address, None)
            if f is None:
                return
            f.stop.set()
            self.model_ids.pop(address, None)
            self.block_sizes.pop(address, None)
            self.index.apply(KvEvent(address, CLEARED))
            calls = [c for c, owner in self._calls.items() if owner is f]
        for c in calls:
            c.cancel()

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            calls = list(self._calls)
            for f in self._feeds.values():
                f.stop.set()
        for c in calls:
            c.cancel()
        for t in self._threads:
            t.join(timeout=5)

    def overlaps(self, hashes: Sequence[bytes], block_size_tokens: int,
                 addresses: Sequence[str] | None = None) -> tuple[list[int], int]:
        """(leading blocks cached per worker, in `addresses` order (default: `workers`);
        leading blocks in the store). A worker that reported another block size (or nothing
        yet, or is not followed) counts 0."""
        with self.lock:
            if addresses is None:
                addresses = list(self._feeds)
            local = [self.index.overlap(a, hashes)
                     if self.block_sizes.get(a) == block_size_tokens else 0
                     for a in addresses]
            models = set(self.model_ids.values())
            store = max((self.index.overlap(store_source(m), hashes) for m in models), default=0)
        return local, store

    # ---- threads -------------------------------------------------------------------------------
    def _spawn(self, name: str, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        t.start()  # before the filter below, which would drop a thread not yet started
        with self.lock:
            # Finished threads go: workers that come and go must not grow this list forever.
            self._threads = [x for x in self._threads if x.is_alive()]
            self._threads.append(t)

    def _start_worker(self, address: str, feed: _WorkerFeed) -> None:
        self._spawn(f"kv-feed-{address}", self._watch_worker, address, feed)

    def _stream(self, call, feed: _WorkerFeed | None = None):
        """Iterate a streaming call that close() (and remove(), for a worker's) can cancel."""
        with self.lock:
            self._calls[call] = feed
        try:
            if feed is not None and feed.stop.is_set():
                return  # removed while connecting: remove() may have missed this call
            yield from call
        finally:
            with self.lock:
                self._calls.pop(call, None)

    def _watch_worker(self, address: str, feed: _WorkerFeed) -> None:
        warned = False
        while not feed.stop.is_set():
            try:
                with rpc.make_channel(address, WORKER) as ch:
                    call = wpb_grpc.WorkerStub(ch).WatchKvEvents(wpb.WatchKvEventsRequest())
                    for batch in self._stream(call, feed):
                        self._apply_worker(address, batch, feed)
                        warned = False
            except grpc.RpcError as e:
                if feed.stop.is_set():
                    return
                if not warned:  # once per outage, not once per retry
                    log.warning("kv events of %s: %s %s; retrying every %.1fs", address,
                                e.code(), e.details(), self.retry_s)
                    warned = True
            feed.stop.wait(self.retry_s)

    def _apply_worker(self, address: str, batch, feed: _WorkerFeed) -> None:
        events = worker_batch_events(address, batch)
        with self.lock:
            if feed.stop.is_set():
                return  # removed: a late batch must not bring its blocks back
            self.model_ids[address] = batch.model_id
            self.block_sizes[address] = batch.block_size_tokens
            self.snapshots += batch.snapshot
            self.index.apply_all(events)
        if self.on_lag is not None and batch.first_event_unix_s > 0:
            self.on_lag(max(0.0, time.time() - batch.first_event_unix_s))

    def _reset_store(self) -> None:
        with self.lock:
            self.store_resets += 1
            for s in self.index.sources:
                if s.startswith("store:"):
                    self.index.apply(KvEvent(s, CLEARED))

    def _watch_store(self) -> None:
        i, after, fresh = 0, 0, True
        while not self._stop.is_set():
            address = self.store_addresses[i % len(self.store_addresses)]
            if fresh:  # a new connection (maybe a new leader, whose event numbers restart)
                self._reset_store()
                after, fresh = 0, False
            try:
                with rpc.make_channel(address, MASTER) as ch:
                    call = mpb_grpc.KVMasterStub(ch).WatchEvents(
                        mpb.WatchEventsRequest(after_seq=after))
                    for ev in self._stream(call):
                        after = ev.seq
                        e = store_event(ev.kind, ev.key)
                        if e is not None:
                            with self.lock:
                                self.index.apply(e)
                continue  # the master ended the stream: ask again from `after`
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                resume = resume_after(e.details())
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and resume is not None:
                    # We fell behind the master's bounded event log: forget, resume at its start.
                    self._reset_store()
                    after = resume
                    continue
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("store at %s has no event stream; store overlaps stay 0", address)
                    return
                log.warning("store events from %s: %s %s", address, e.code(), e.details())
                i += 1
                fresh = True
            self._stop.wait(self.retry_s)
