"""The router's view of one role's workers, and the thin adapter around a routing policy.

Owns the stubs, the requests and predicted prefill tokens in flight per worker, the workers'
last reported stats (a poller thread calls GetStats; a worker that answers UNAVAILABLE is
skipped until it answers again), and `pick()`: build the policy's `RouteInput` (the prompt's
chained block hashes, computed exactly as the engine does, looked up in the block index), ask
the policy, hold the choice for the request's duration. Must not score workers itself: the
policies in `policy.py` do, as pure functions of the input.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from collections.abc import Sequence

import grpc

from pdserve import rpc
from pdserve.engine.block_pool import prompt_block_hashes
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.router.kv_feed import KvFeeds
from pdserve.router.policy import KvAware, RouteDecision, RouteInput, WorkerLoad

log = logging.getLogger(__name__)


class WorkerPool:
    def __init__(self, addresses: Sequence[str], policy, *, block_size_tokens: int = 16,
                 feeds: KvFeeds | None = None, stats_interval_s: float = 0.0) -> None:
        self.addresses = list(addresses)
        self.channels = [rpc.make_channel(a) for a in self.addresses]
        self.stubs = [wpb_grpc.WorkerStub(c) for c in self.channels]
        self.in_flight = [0] * len(self.addresses)
        self.in_flight_tokens = [0.0] * len(self.addresses)
        self.healthy = [True] * len(self.addresses)
        self.stats: list[wpb.WorkerStats | None] = [None] * len(self.addresses)
        self.policy = policy
        self.block_size_tokens = block_size_tokens
        self.feeds = feeds
        self.last_decision: RouteDecision | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._poller = None
        if stats_interval_s > 0:
            self._poller = threading.Thread(target=self._poll, args=(stats_interval_s,),
                                            name="worker-stats", daemon=True)
            self._poller.start()

    def _prefix(self, prompt_ids: Sequence[int] | None, salt: str) -> tuple[list[int], int]:
        """(leading blocks cached per worker, leading blocks in the store) of this prompt."""
        n = len(self.addresses)
        if self.feeds is None or not isinstance(self.policy, KvAware) or not prompt_ids:
            return [0] * n, 0
        # The engine reuses whole blocks of all prompt tokens but the last (same hashes as the
        # prefill role's store lookup and the scheduler's prefix match).
        hashes = prompt_block_hashes(list(prompt_ids[:-1]), self.block_size_tokens, salt)
        return self.feeds.overlaps(hashes, self.block_size_tokens)

    def _input(self, local: list[int], store: int, prompt_tokens: int,
               extra_tokens: int) -> RouteInput:
        """The policy's input (the pool's lock held, so loads and stats agree)."""
        workers = []
        for i, a in enumerate(self.addresses):
            s = self.stats[i]
            workers.append(WorkerLoad(
                a, self.in_flight[i], self.healthy[i], self.in_flight_tokens[i], local[i],
                free_blocks=None if s is None else s.num_free_blocks,
                running=0 if s is None else s.num_running, waiting=0 if s is None else s.num_waiting))
        need = -(-(prompt_tokens + extra_tokens) // self.block_size_tokens)
        return RouteInput(tuple(workers), prompt_tokens, self.block_size_tokens, store, need)

    @contextmanager
    def pick(self, prompt_ids: Sequence[int] | None = None, salt: str = "",
             extra_tokens: int = 0):
        """Choose a worker for one request and count it in flight until the block exits.
        `extra_tokens`: tokens the request may add (max_tokens), for decode's KV fit."""
        local, store = self._prefix(prompt_ids, salt)  # outside the pool lock: hashing takes time
        with self._lock:
            inp = self._input(local, store, len(prompt_ids or ()), extra_tokens)
            d = self.policy.decide(inp)
            i = d.index
            tokens = d.work_tokens if d.work_tokens is not None else inp.prompt_tokens
            self.in_flight[i] += 1
            self.in_flight_tokens[i] += tokens
            self.last_decision = d
        if d.scores:
            log.debug("routed to %s: %s", self.addresses[i], d.scores)
        try:
            yield self.stubs[i]
        finally:
            with self._lock:
                self.in_flight[i] -= 1
                self.in_flight_tokens[i] -= tokens

    def _poll(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            for i, stub in enumerate(self.stubs):
                try:
                    s = stub.GetStats(wpb.GetStatsRequest(), timeout=max(1.0, 2 * interval_s))
                    healthy = True
                except grpc.RpcError as e:
                    s, healthy = None, e.code() != grpc.StatusCode.UNAVAILABLE
                with self._lock:
                    if s is not None:
                        self.stats[i] = s
                    if healthy != self.healthy[i]:
                        log.warning("worker %s is %s", self.addresses[i],
                                    "back" if healthy else "unavailable; skipping it")
                    self.healthy[i] = healthy

    def close(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=5)
        if self.feeds is not None:
            self.feeds.close()
        for c in self.channels:
            c.close()

