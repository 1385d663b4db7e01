"""Keeps the router's block index (`KvIndex`) current from the cluster's event streams.

Owns one stream per known worker (started when it joins, cancelled when it is forgotten),
subscribed to its `WatchKvEvents` (a snapshot of the worker's prefix cache, then its changes),
and one to the store master's `WatchEvents` (objects stored, evicted, removed; keys mapped
back to block hashes with `parse_key`), all of them tasks on one event loop in one thread.
Each stream reconnects after an error; a snapshot, a reconnect to the store or lost store
events reset what the index knows of that source first.
The index is read under the same lock (`overlaps`). Must not choose workers: that is the
policy's job (`policy.py`).

Staleness is allowed by design: between an eviction and its event the index claims a block that
is gone, and the worker simply computes it. Routing gets less good, never wrong.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable, Sequence

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


class _WorkerFeed:
    """One worker's event stream: its task on the feeds' event loop (None until started)."""

    def __init__(self) -> None:
        self.task: asyncio.Task | None = None
        self.stopped = False


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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._closed = False
        self._store_task: asyncio.Task | None = None
        self._feeds: dict[str, _WorkerFeed] = {a: _WorkerFeed() for a in worker_addresses}

    @property
    def workers(self) -> list[str]:
        """Workers fed now, in the order they were added."""
        with self.lock:
            return list(self._feeds)

    def start(self) -> "KvFeeds":
        """Start the event loop every stream runs on (one thread, whatever the workers)."""
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def run() -> None:
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.close()
        self._thread = threading.Thread(target=run, name="kv-feeds", daemon=True)
        self._thread.start()
        ready.wait()
        with self.lock:
            self._loop = loop
            feeds = list(self._feeds.items())
        for a, f in feeds:
            self._submit(self._start_worker, a, f)
        if self.store_addresses:
            self._submit(self._start_store)
        return self

    def add(self, address: str) -> None:
        """Follow `address`'s prefix cache (a worker joined); a no-op if already followed."""
        with self.lock:
            if address in self._feeds or self._closed:
                return
            f = self._feeds[address] = _WorkerFeed()
            started = self._loop is not None
        if started:
            self._submit(self._start_worker, address, f)

    def remove(self, address: str) -> None:
        """Stop following `address` (it was forgotten) and forget what it cached."""
        with self.lock:
            f = self._feeds.pop(address, None)
            if f is None:
                return
            f.stopped = True
            self.model_ids.pop(address, None)
            self.block_sizes.pop(address, None)
            self.index.apply(KvEvent(address, CLEARED))
        self._submit(self._cancel, f)

    def close(self) -> None:
        with self.lock:
            self._closed = True
            loop, self._loop = self._loop, None
            for f in self._feeds.values():
                f.stopped = True
        if loop is None:
            return

        async def stop() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            loop.stop()
        asyncio.run_coroutine_threadsafe(stop(), loop)
        if self._thread is not None:
            self._thread.join(timeout=5)

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

    # ---- the event loop ------------------------------------------------------------------------
    # Every stream is a task on one loop: no thread per worker, and a stream waiting for events
    # costs nothing (the synchronous API wakes each blocked stream every 0.1 s, and keeps a
    # polling thread per channel).
    def _submit(self, fn, *args) -> None:
        with self.lock:
            loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(fn, *args)

    def _start_worker(self, address: str, feed: _WorkerFeed) -> None:
        if not feed.stopped:
            feed.task = asyncio.get_running_loop().create_task(self._watch_worker(address, feed))

    def _start_store(self) -> None:
        self._store_task = asyncio.get_running_loop().create_task(self._watch_store())

    @staticmethod
    def _cancel(feed: _WorkerFeed) -> None:
        if feed.task is not None:
            feed.task.cancel()

    async def _watch_worker(self, address: str, feed: _WorkerFeed) -> None:
        warned = False
        while not feed.stopped:
            channel = rpc.make_aio_channel(address, WORKER)
            try:
                call = wpb_grpc.WorkerStub(channel).WatchKvEvents(wpb.WatchKvEventsRequest())
                async for batch in call:
                    self._apply_worker(address, batch, feed)
                    warned = False
            except grpc.RpcError as e:
                if feed.stopped:
                    return
                if not warned:  # once per outage, not once per retry
                    log.warning("kv events of %s: %s %s; retrying every %.1fs", address,
                                e.code(), e.details(), self.retry_s)
                    warned = True
            finally:
                await channel.close()
            await asyncio.sleep(self.retry_s)

    def _apply_worker(self, address: str, batch, feed: _WorkerFeed) -> None:
        events = worker_batch_events(address, batch)
        with self.lock:
            if feed.stopped:
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

    async def _watch_store(self) -> None:
        i, after, fresh = 0, 0, True
        while True:
            address = self.store_addresses[i % len(self.store_addresses)]
            if fresh:  # a new connection (maybe a new leader, whose event numbers restart)
                self._reset_store()
                after, fresh = 0, False
            channel = rpc.make_aio_channel(address, MASTER)
            try:
                call = mpb_grpc.KVMasterStub(channel).WatchEvents(
                    mpb.WatchEventsRequest(after_seq=after))
                async for ev in call:
                    after = ev.seq
                    e = store_event(ev.kind, ev.key)
                    if e is not None:
                        with self.lock:
                            self.index.apply(e)
                continue  # the master ended the stream: ask again from `after`
            except grpc.RpcError as e:
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
            finally:
                await channel.close()
            await asyncio.sleep(self.retry_s)
