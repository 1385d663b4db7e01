"""Prompts a decode worker computed itself, put to the store for the rest of the cluster.

Owns the put of the full prompt blocks of a request prefilled on a decode worker (the
controller's prefill offload, a request resumed here), so that the next request with that
prompt, on whichever prefill worker, finds them in the store as a prefix (the prefill role asks
the store before computing) instead of computing them again. Without it, a prompt offloaded
once stays a miss for every prefill worker: a burst repeating it computes it again.

How: after a locally prefilled request's first token, `offer` posts one read to the engine
thread (between steps: copies of the prompt's leading blocks the pool holds), which queues them
for one publishing thread that puts the blocks the store lacks. The queue is bounded in blocks
(`max_pending_blocks`); an offer that does not fit is dropped and counted, since publishing only
saves later work. A put the store refuses is counted and logged; nothing else is affected.
Must not block the engine thread or a request's relay, and must not decide routing.
"""

from __future__ import annotations

import logging
import queue
import threading

from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.kv_blocks import put_missing, reusable_prefix

log = logging.getLogger(__name__)

# About 47 MB of SmolLM2-135M fp32 blocks (16 tokens, 30 layers): a burst of offloaded prompts.
MAX_PENDING_BLOCKS = 64


class PromptPublisher:
    def __init__(self, loop: EngineLoop, store, model_id: str,
                 max_pending_blocks: int = MAX_PENDING_BLOCKS) -> None:
        if max_pending_blocks < 1:
            raise ValueError(f"max_pending_blocks must be >= 1, got {max_pending_blocks!r}")
        self.loop, self.store, self.model_id = loop, store, model_id
        self.max_pending_blocks = max_pending_blocks
        self.blocks_put = 0  # blocks the store lacked and was given
        self.offers_dropped = 0  # offers past the queue's bound
        self.put_failures = 0  # offers the store refused
        self._pending = 0  # blocks queued, guarded by _lock
        self._lock = threading.Lock()
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-publish", daemon=True)
        self._thread.start()

    def offer(self, prompt_ids: list[int], salt: str) -> None:
        """Publish the full blocks of this prompt the local pool holds (called once its first
        token is out, so the prompt's KV is in the pool). Returns at once."""
        engine = self.loop.engine
        # The blocks a prefill worker looks up (`PrefillRole._enter` asks the same keys).
        hashes, keys = reusable_prefix(engine, self.model_id, prompt_ids, salt)
        if not hashes:
            return

        def read() -> None:  # on the engine thread, between steps
            with self._lock:
                room = self.max_pending_blocks - self._pending
                if room <= 0:
                    self.offers_dropped += 1
                    return
                blocks = engine.read_cached_blocks(hashes[:room])
                self._pending += len(blocks)
            if blocks:
                self._q.put((keys[:len(blocks)], [b for _, b in blocks]))

        self.loop.post(read)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            keys, blocks = item
            try:
                n = put_missing(self.store, keys, blocks)
                with self._lock:
                    self.blocks_put += n
            except Exception as e:  # StoreFailure, StagingError, a store closed at shutdown
                with self._lock:
                    self.put_failures += 1
                log.warning("a locally prefilled prompt's KV was not stored: %s", e)
            finally:
                with self._lock:
                    self._pending -= len(keys)

    def close(self) -> None:
        """Stop after the offers already queued (at most 5 s)."""
        self._q.put(None)
        self._thread.join(timeout=5)
