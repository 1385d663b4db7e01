"""The prefill role: prefill a prompt, sample its first token, put its KV blocks to the store.

Owns the prefill side of the hand-over, and the store as a cluster-wide prefix cache: before
computing, the prompt's leading blocks that the store holds (written by any worker) and the local
pool does not are fetched and placed in the local prefix cache, so prefill skips them. Blocks the
store already holds are not written again. A prompt joins the engine at the first step boundary
after it arrives unless blocks must be fetched first: the store is asked off the engine thread,
then one trip through the engine loop checks the local pool and adds the request. Must not decide
routing.

With a `KvStreamSender` (progressive transfer, `--progressive-kv`) the prompt's computed KV is
streamed layer by layer while prefill runs (anchor planes first, residuals after; see
`kv_sender`) and is not put as whole blocks; only the blocks before the first computed position
(a prefix served from the local pool or the store) are put whole, as in the plain transfer. The
result returns as soon as the first token is sampled, without waiting for the stream to drain.
A request that could not be streamed whole (sender queue over its bound, a chunk recomputed
after preemption) falls back to the plain whole-block put.

The store is not needed to answer: a prefix lookup that fails computes the whole prompt, and a
put that fails still returns the first token and the KV handle (the decode side, finding the
blocks missing, recomputes the prompt; same tokens, never a lost request). While the store is
degraded a stream is not handed over (its objects are likely missing too): the handle names
whole blocks, so the decode side recomputes at once instead of waiting for anchors. A caller that
goes away, or a prefill that outlives `result_timeout_s`, is aborted in the engine, so its KV
blocks go back to the pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from pdserve.core.sampling_params import SamplingParams, TokenLogprobs
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.prefill.kv_sender import KvStreamSender
from pdserve.worker.guarded_store import StoreFailure
from pdserve.worker.kv_blocks import block_key, fetch_run, put_missing, reusable_prefix
from pdserve.worker.kv_staging import StagingError

log = logging.getLogger(__name__)
_POLL_S = 0.05


class PrefillCancelled(Exception):
    """The caller went away (cancelled, or its deadline passed); the request was aborted."""


class PrefillTimeout(TimeoutError):
    """The prefill did not finish within the role's result timeout; the request was aborted."""


@dataclass
class PrefillResult:
    first_token: int
    finish_reason: str | None
    block_hashes: list[bytes]
    keys: list[str]
    num_tokens: int
    num_cached_tokens: int
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs
    # Progressive transfer: the stream's id and the prompt ranges each chunk computed
    # ("" and [] for a plain transfer).
    stream_id: str = ""
    spans: list[tuple[int, int]] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # when the request asked for them


class PrefillRole:
    def __init__(self, loop: EngineLoop, store, model_id: str,
                 result_timeout_s: float = 600.0, sender: KvStreamSender | None = None) -> None:
        self.loop = loop
        self.sender = sender
        if sender is not None:
            loop.engine.on_prefill_layer = sender.on_layer
        self.store = store
        self.model_id = model_id
        self.timeout_s = result_timeout_s
        self.blocks_put = 0
        self.blocks_deduped = 0
        self.blocks_from_store = 0
        self.put_failures = 0  # requests whose KV could not be put (the decode side recomputes)
        self._lock = threading.Lock()

    def _store_prefix(self, keys: list[str]) -> int:
        """Leading blocks of `keys` the store holds (0 when it cannot be asked)."""
        if not keys:
            return 0
        try:
            return self.store.longest_prefix(keys)
        except StoreFailure as e:
            log.warning("prefix lookup failed, computing the whole prompt: %s", e)
            return 0

    def _enter(self, prompt_ids: list[int], salt: str, add: Callable[[], Any],
               fetch: bool = True):
        """Put the request into the engine (`add`, run on the engine thread), first placing what
        the store holds of its prefix beyond the local prefix cache (unless not `fetch`: a
        request that computes its whole prompt); `add`'s result.

        The store is asked first, off the engine thread (while a step may run), so that a
        request the store cannot help joins the engine in one trip through the loop: the
        first step boundary after it arrived. Asking the local cache first would take a trip
        of its own, and a burst arriving during a step would then miss the next step too."""
        engine = self.loop.engine
        hashes, keys = reusable_prefix(engine, self.model_id, prompt_ids, salt)
        n_store = self._store_prefix(keys) if fetch else 0

        def first():
            n_local = engine.cached_prefix_blocks(hashes) if hashes else 0
            return (n_local, None) if n_store > n_local else (n_local, add())

        n_local, added = self.loop.call(first)
        if n_store <= n_local:
            return added
        blocks = fetch_run(self.store, engine, hashes[n_local:n_store], keys[n_local:n_store])

        def place_and_add():
            return (engine.import_cached_blocks(blocks) if blocks else 0), add()

        placed, added = self.loop.call(place_and_add)
        with self._lock:
            self.blocks_from_store += placed
        return added

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                salt: str = "", is_active: Callable[[], bool] = lambda: True) -> PrefillResult:
        engine = self.loop.engine
        sender = self.sender
        # Unique per attempt: a retried prefill never mixes its planes with an earlier one's.
        stream_id = f"{request_id}-{uuid.uuid4().hex[:12]}" if sender is not None else ""

        def add():
            stream = self.loop.open_stream(request_id)
            try:
                if sender is not None:
                    sender.register(request_id, self.model_id, stream_id)
                engine.add_request(request_id, prompt_ids, params, salt=salt, prefill_only=True)
            except Exception:
                self.loop.close_stream(request_id)
                if sender is not None:
                    sender.finish(request_id)
                raise
            return stream

        stream = self._enter(prompt_ids, salt, add, fetch=params.prompt_logprobs is None)
        try:
            item = self._wait(request_id, stream, is_active)
        finally:
            self.loop.close_stream(request_id)
            spans = sender.finish(request_id) if sender is not None else None
        if item.error is not None:
            raise item.error
        assert item.output is not None and item.kv is not None
        kv = item.kv
        layers = engine.model_config.num_hidden_layers
        keys = [block_key(self.model_id, salt, h, layers) for h in kv.block_hashes]
        whole = len(keys)  # blocks put whole: all, or (streaming) those before the first span
        if (spans and spans[0][0] % engine.block_size == 0 and spans[-1][1] == kv.num_tokens
                and not self._store_degraded()):
            whole = spans[0][0] // engine.block_size
        else:
            spans, stream_id = None, ""
        put = self._put_blocks(request_id, keys[:whole], kv.blocks[:whole])
        with self._lock:
            if put < 0:
                self.put_failures += 1
            else:
                self.blocks_put += put
                self.blocks_deduped += whole - put
        out = item.output
        return PrefillResult(out.new_token_ids[0], out.finish_reason if out.finished else None,
                             kv.block_hashes, keys, kv.num_tokens, out.num_cached_tokens,
                             out.logprobs[0] if out.logprobs else None, stream_id, spans,
                             out.prompt_logprobs)

    def _wait(self, request_id: str, stream, is_active: Callable[[], bool]):
        """The request's one stream item (first token + KV); a caller gone, or no item within
        the result timeout, aborts the request in the engine (its blocks are freed there)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return stream.get(timeout=_POLL_S)
            except queue.Empty:
                pass
            if not is_active():
                self.loop.post(lambda: self.loop.engine.abort(request_id))
                raise PrefillCancelled(f"prefill of {request_id}: the caller went away")
            if time.monotonic() > deadline:
                self.loop.post(lambda: self.loop.engine.abort(request_id))
                raise PrefillTimeout(f"prefill of {request_id} did not finish within "
                                     f"{self.timeout_s:g}s; aborted")

    def _put_blocks(self, request_id: str, keys: list[str], blocks) -> int:
        """Puts the blocks the store lacks; how many it put, or -1 when the store failed (the
        request is served anyway: the decode side recomputes what it cannot fetch)."""
        try:
            return put_missing(self.store, keys, blocks)
        except (StoreFailure, StagingError) as e:
            log.warning("%s: KV not stored, the decode side will recompute it: %s",
                        request_id, e)
            return -1

    def _store_degraded(self) -> bool:
        view = getattr(self.store, "view", None)
        return bool(view and view().degraded)
