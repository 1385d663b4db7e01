"""The decode role: pull a prefilled request's KV blocks and decode it in the running batch.

Owns the decode side of the hand-over: blocks the local pool already caches are not fetched;
the rest come from the store. A block the store cannot return (evicted, node lost, the store
down or never given it: a prefill whose put failed) ends the import there and the engine
recomputes the remainder locally: slower, never wrong (counted in `kv_recomputed_requests`).
A streamed request (progressive transfer, `StreamHandle`) is read by `progressive`: joined on
its anchors and made exact when the residuals land, or joined exact when they already have.
A request sent to be prefilled here (`decode_local`, the controller's prefill offload) carries no
KV: it joins as a whole request whose prompt chunks, at most `chunk_tokens` a step, run in the
decode batches, and streams every token, the first one included, the same way. So does a request
resumed here after the decode worker serving it died: the tokens it already emitted are
computed with the prompt, and only the ones after them are streamed. The full blocks of a prompt
prefilled here are put to the store (`publish`), as a prefill worker's are.
Must not decide routing.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from pdserve.worker.decode.migrate import SequenceMoved
from pdserve.worker.decode.progressive import ResidualWaiter, StreamReader
from pdserve.worker.decode.publish import PromptPublisher
from pdserve.core.sampling_params import SamplingParams, TokenLogprobs
from pdserve.worker.engine_loop import EngineLoop, RequestStream
from pdserve.worker.kv_blocks import fetch_run, reusable_prefix
from pdserve.worker.kv_stream import StreamHandle

log = logging.getLogger(__name__)


@dataclass
class DecodeChunk:
    token_ids: list[int]
    finish_reason: str | None  # set on the last chunk
    logprobs: list[TokenLogprobs] | None = None  # parallel to token_ids, when asked for
    made_s: float = 0.0  # wall clock when the step that made the first of token_ids ended
    prompt_logprobs: list[TokenLogprobs] | None = None  # first chunk, when asked for
    moved: bool = False  # the request moved off this worker with its KV (`migrate.py`): last


class DecodeRole:
    def __init__(self, loop: EngineLoop, store, poll_s: float = 0.05,
                 stream_wait_s: float = 30.0, publisher: PromptPublisher | None = None,
                 model_id: str = "") -> None:
        self.loop = loop
        self.store = store
        self.model_id = model_id  # the store keys' model: resumed requests' blocks are fetched
        self.publisher = publisher  # puts the prompts prefilled here to the store
        self.poll_s = poll_s
        self.reader = StreamReader(store, loop.engine, stream_wait_s)
        self.blocks_fetched = 0
        self.blocks_local = 0
        self.resumed_tokens_computed = 0  # prompt and resumed tokens a resumed request computed
        self.progressive_requests = 0
        self.progressive_anchor_joins = 0
        self.progressive_exact_joins = 0
        self.progressive_fallbacks = 0
        self.local_prefill_requests = 0
        self.local_prefill_tokens = 0
        self.kv_recomputed_requests = 0  # prompts whose KV was recomputed, in part, here
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def _stream_blocks(self, request_id: str, hashes: list[bytes], keys: list[str],
                       n_prompt: int, h: StreamHandle, is_active):
        """(blocks, approximate, anchors, prefix) for a streamed request: see `progressive`."""
        bs = self.loop.engine.block_size
        self._count("progressive_requests")
        n_pre = h.start // bs
        prefix = self._fetch(hashes[:n_pre], keys[:n_pre], n_pre * bs)
        if len(prefix) < n_pre:  # a prefix block lost: recompute from there
            self._count("progressive_fallbacks")
            return prefix, False, None, prefix
        anchors = self.reader.fetch(h, "anchor", time.monotonic() + self.reader.wait_s,
                                    is_active)
        if anchors is None:
            log.warning("anchors of %s late past %.1fs: recomputing the prompt", request_id,
                        self.reader.wait_s)
            self._count("progressive_fallbacks")
            return prefix, False, None, prefix
        if self.reader.all_present(h, "residual"):
            res = self.reader.fetch(h, "residual", time.monotonic(), is_active)
            if res is not None:
                log.info("residuals of %s already stored: joining exact", request_id)
                self._count("progressive_exact_joins")
                return (prefix + self.reader.to_blocks(h, hashes, n_prompt, anchors, res),
                        False, None, prefix)
        self._count("progressive_anchor_joins")
        return (prefix + self.reader.to_blocks(h, hashes, n_prompt, anchors, None), True,
                anchors, prefix)

    def _fetch(self, hashes: list[bytes], keys: list[str], n_prompt: int):
        engine = self.loop.engine
        bs = engine.block_size
        full = n_prompt // bs
        n_local = self.loop.call(lambda: engine.cached_prefix_blocks(hashes[:full]))
        blocks = [(h, None) for h in hashes[:n_local]]
        blocks += fetch_run(self.store, engine, hashes[n_local:], keys[n_local:])
        with self._lock:
            self.blocks_local += n_local
            self.blocks_fetched += len(blocks) - n_local
        return blocks

    def decode(self, request_id: str, prompt_ids: list[int], first_token: int,
               params: SamplingParams, hashes: list[bytes], keys: list[str], salt: str,
               is_active: Callable[[], bool], stream: StreamHandle | None = None
               ) -> Iterator[DecodeChunk]:
        engine = self.loop.engine
        approximate, anchors, prefix = False, None, []
        if stream is not None:
            blocks, approximate, anchors, prefix = self._stream_blocks(
                request_id, hashes, keys, len(prompt_ids), stream, is_active)
        else:
            blocks = self._fetch(hashes, keys, len(prompt_ids))
        if len(blocks) < len(hashes):
            log.info("%s: %d of %d prompt blocks from the store or the local cache; recomputing "
                     "the rest", request_id, len(blocks), len(hashes))
            self._count("kv_recomputed_requests")

        def add():
            out = self.loop.open_stream(request_id)
            try:
                reason = engine.add_prefilled_request(request_id, prompt_ids, first_token,
                                                      params, blocks, salt=salt,
                                                      approximate=approximate)
            except Exception:
                self.loop.close_stream(request_id)
                raise
            if reason is not None:  # the first token already ended it
                self.loop.close_stream(request_id)
            return out, reason

        out_stream, reason = self.loop.call(add)
        if reason is not None:
            yield DecodeChunk([], reason)
            return
        cancelled = threading.Event()
        if approximate:
            def readd() -> bool:
                """Engine thread: the residuals are not coming; recompute the prompt exactly.
                The request has emitted nothing on the anchors, so nothing is taken back."""
                seq = engine.seqs.get(request_id)
                if seq is None or not seq.anchor_from:
                    return False  # gone, finished, or made exact by a preemption meanwhile
                engine.abort(request_id)
                engine.add_prefilled_request(request_id, prompt_ids, first_token, params,
                                             prefix, salt=salt)
                return True

            assert stream is not None and anchors is not None
            ResidualWaiter(self.loop, self.reader, request_id, stream, hashes, len(prompt_ids),
                           anchors, prefix, readd,
                           lambda: self._count("progressive_fallbacks"), cancelled).start()
        try:
            yield from self._relay(request_id, out_stream, is_active)
        finally:
            cancelled.set()

    def decode_local(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                     salt: str, chunk_tokens: int, is_active: Callable[[], bool],
                     resume_ids: list[int] | None = None) -> Iterator[DecodeChunk]:
        """Prefill here and decode on: `chunk_tokens` (0: the step budget) bounds the prompt
        tokens per step, so the running decodes' step time stays bounded. `resume_ids`: the
        tokens the request already emitted elsewhere; computed after the prompt, not sent."""
        engine = self.loop.engine
        resume_ids = resume_ids or []
        # Resumed (its worker moved it here, or died): the full blocks of its prompt and the
        # tokens it emitted that the store holds are fetched, so only the rest is computed.
        moved_in = self._fetch_resumed(prompt_ids + resume_ids, salt) if resume_ids else []

        def add():
            if moved_in:
                engine.import_cached_blocks(moved_in)
            out = self.loop.open_stream(request_id)
            try:
                engine.add_request(request_id, prompt_ids, params, salt=salt,
                                   max_chunk_tokens=chunk_tokens, resume_token_ids=resume_ids)
            except Exception:
                self.loop.close_stream(request_id)
                raise
            return out

        out_stream = self.loop.call(add)
        with self._lock:
            self.local_prefill_requests += 1
            # Every token computed here before the first one sampled, resumed ones included.
            self.local_prefill_tokens += len(prompt_ids) + len(resume_ids)
        # The prompt's KV is in the pool once a token is out.
        publish = (functools.partial(self.publisher.offer, prompt_ids, salt)
                   if self.publisher is not None else None)
        yield from self._relay(request_id, out_stream, is_active, publish)

    def _fetch_resumed(self, ids: list[int], salt: str) -> list:
        """The leading full blocks of `ids` the store holds and this pool lacks, read."""
        if self.store is None or not self.model_id:
            return []
        engine = self.loop.engine
        hashes, keys = reusable_prefix(engine, self.model_id, ids, salt)
        n_local = self.loop.call(lambda: engine.cached_prefix_blocks(hashes))
        blocks = fetch_run(self.store, engine, hashes[n_local:], keys[n_local:])
        with self._lock:
            self.blocks_local += n_local
            self.blocks_fetched += len(blocks)
            # What is left to compute before its next token: the last, partial block where the
            # store had the rest; from the first block it lacked otherwise.
            self.resumed_tokens_computed += len(ids) - (n_local + len(blocks)) * engine.block_size
        return blocks

    def _relay(self, request_id: str, out_stream: RequestStream, is_active: Callable[[], bool],
               on_first: Callable[[], None] | None = None) -> Iterator[DecodeChunk]:
        """The request's step outputs as chunks until it finishes (the steps queued while this
        thread waited coalesce into one chunk); a client that is gone, or stops reading, aborts
        it in the engine. `on_first` runs once, when the first tokens are out."""
        try:
            while True:
                try:
                    item = out_stream.get(timeout=self.poll_s)
                except queue.Empty:
                    if not is_active():
                        self._drop(request_id)
                        return
                    continue
                chunk, finished, pending = _coalesce(item, out_stream)
                if on_first is not None and chunk.token_ids:
                    on_first()
                    on_first = None
                yield chunk
                if finished:
                    return
                if pending is not None:
                    raise pending.error
        except SequenceMoved:  # after every token made here (`migrate.py`)
            yield DecodeChunk([], None, moved=True)
        except GeneratorExit:
            self._drop(request_id)
            raise

    def _drop(self, request_id: str) -> None:
        """The caller is gone: abort the request between two steps, without waiting for it (a
        long step must not hold this thread)."""
        self.loop.close_stream(request_id)
        self.loop.post(lambda: self.loop.engine.abort(request_id))

    def abort(self, request_id: str) -> bool:
        self.loop.close_stream(request_id)
        return self.loop.call(lambda: self.loop.engine.abort(request_id))


def _coalesce(item, out_stream: RequestStream) -> tuple[DecodeChunk, bool, object]:
    """`item` and every step output already queued behind it, as one chunk: a reader that fell
    behind the engine (its thread waited for the GIL or the network) catches up in one message
    instead of one per token. Returns (chunk, finished, an error item read after the chunk's
    tokens, to raise on the next read) ; an error with no token before it raises here."""
    tokens: list[int] = []
    logprobs: list[TokenLogprobs] | None = []
    made_s = item.made_s
    prompt_lps = None
    while True:
        if item.error is not None:
            if tokens:
                return DecodeChunk(tokens, None, logprobs, made_s, prompt_lps), False, item
            raise item.error
        out = item.output
        assert out is not None
        tokens.extend(out.new_token_ids)
        logprobs = None if out.logprobs is None or logprobs is None else logprobs + out.logprobs
        prompt_lps = prompt_lps or out.prompt_logprobs
        if out.finished:
            return DecodeChunk(tokens, out.finish_reason, logprobs, made_s, prompt_lps), True, None
        try:
            item = out_stream.q.get_nowait()
        except queue.Empty:
            return DecodeChunk(tokens, None, logprobs, made_s, prompt_lps), False, None
