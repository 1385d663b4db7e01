"""Keeps the router's block index (`KvIndex`) current from the cluster's event streams.

Owns one daemon thread per prefill worker, subscribed to its `WatchKvEvents` (a snapshot of the
worker's prefix cache, then its changes), and one for the store master's `WatchEvents` (objects
stored, evicted, removed; keys mapped back to block hashes with `parse_key`). Each thread
reconnects after an error; a snapshot, a reconnect to the store or lost store events reset what
the index knows of that source first. The index is read under the same lock (`overlaps`).
Must not choose workers: that is the policy's job (`policy.py`).

Staleness is allowed by design: between an eviction and its event the index claims a block that
is gone, and the worker simply computes it. Routing gets less good, never wrong.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Sequence

import grpc

from pdserve import rpc
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


class KvFeeds:
    def __init__(self, worker_addresses: Sequence[str], store_address: str = "",
                 index: KvIndex | None = None, retry_s: float = 1.0) -> None:
        self.workers = list(worker_addresses)
        self.store_addresses = [a for a in store_address.split(",") if a]
        self.index = index if index is not None else KvIndex()
        self.retry_s = retry_s
        self.lock = threading.Lock()
        self.model_ids: dict[str, str] = {}  # worker address -> model id it reported
        self.block_sizes: dict[str, int] = {}  # worker address -> block size it reported
        self.snapshots = 0  # worker snapshots applied (first subscription, resyncs)
        self.store_resets = 0
        self._stop = threading.Event()
        self._calls: set = set()
        self._threads: list[threading.Thread] = []

    def start(self) -> "KvFeeds":
        for a in self.workers:
            self._spawn(f"kv-feed-{a}", self._watch_worker, a)
        if self.store_addresses:
            self._spawn("kv-feed-store", self._watch_store)
        return self

    def close(self) -> None:
        self._stop.set()
        with self.lock:
            calls = list(self._calls)
        for c in calls:
            c.cancel()
        for t in self._threads:
            t.join(timeout=5)

    def overlaps(self, hashes: Sequence[bytes], block_size_tokens: int
                 ) -> tuple[list[int], int]:
        """(leading blocks cached per worker, in `workers` order; leading blocks in the store).
        A worker that reported another block size (or nothing yet) counts 0."""
        with self.lock:
            local = [self.index.overlap(a, hashes)
                     if self.block_sizes.get(a) == block_size_tokens else 0
                     for a in self.workers]
            models = set(self.model_ids.values())
            store = max((self.index.overlap(store_source(m), hashes) for m in models), default=0)
        return local, store

    # ---- threads -------------------------------------------------------------------------------
    def _spawn(self, name: str, target, *args) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def _stream(self, call):
        """Iterate a streaming call that close() can cancel."""
        with self.lock:
            self._calls.add(call)
        try:
            yield from call
        finally:
            with self.lock:
                self._calls.discard(call)

    def _watch_worker(self, address: str) -> None:
        warned = False
        while not self._stop.is_set():
            try:
                with rpc.make_channel(address) as ch:
                    call = wpb_grpc.WorkerStub(ch).WatchKvEvents(wpb.WatchKvEventsRequest())
                    for batch in self._stream(call):
                        self._apply_worker(address, batch)
                        warned = False
            except grpc.RpcError as e:
                if self._stop.is_set():
                    return
                if not warned:  # once per outage, not once per retry
                    log.warning("kv events of %s: %s %s; retrying every %.1fs", address,
                                e.code(), e.details(), self.retry_s)
                    warned = True
            self._stop.wait(self.retry_s)

    def _apply_worker(self, address: str, batch) -> None:
        events = worker_batch_events(address, batch)
        with self.lock:
            self.model_ids[address] = batch.model_id
            self.block_sizes[address] = batch.block_size_tokens
            self.snapshots += batch.snapshot
            self.index.apply_all(events)

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
                with rpc.make_channel(address) as ch:
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
