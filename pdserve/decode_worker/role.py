"""The decode role: pull a prefilled request's KV blocks and decode it in the running batch.

Owns the decode side of the hand-over: blocks the local pool already caches are not fetched;
the rest come from the store. A block the store cannot return (evicted, node lost) ends the
import there and the engine recomputes the remainder locally: slower, never wrong.
Must not decide routing.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from pdserve.engine.sampling import SamplingParams, TokenLogprobs
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.kv_blocks import fetch_run



@dataclass
class DecodeChunk:
    token_ids: list[int]
    finish_reason: str | None  # set on the last chunk
    logprobs: list[TokenLogprobs] | None = None  # parallel to token_ids, when asked for


class DecodeRole:
    def __init__(self, loop: EngineLoop, store, poll_s: float = 0.05) -> None:
        self.loop = loop
        self.store = store
        self.poll_s = poll_s
        self.blocks_fetched = 0
        self.blocks_local = 0
        self._lock = threading.Lock()

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
               is_active: Callable[[], bool]) -> Iterator[DecodeChunk]:
        engine = self.loop.engine
        blocks = self._fetch(hashes, keys, len(prompt_ids))

        def add():
            stream = self.loop.open_stream(request_id)
            try:
                reason = engine.add_prefilled_request(request_id, prompt_ids, first_token,
                                                      params, blocks, salt=salt)
            except Exception:
                self.loop.close_stream(request_id)
                raise
            if reason is not None:  # the first token already ended it
                self.loop.close_stream(request_id)
            return stream, reason

        stream, reason = self.loop.call(add)
        if reason is not None:
            yield DecodeChunk([], reason)
            return
        try:
            while True:
                try:
                    item = stream.get(timeout=self.poll_s)
                except queue.Empty:
                    if not is_active():
                        self.abort(request_id)
                        return
                    continue
                if item.error is not None:
                    raise item.error
                out = item.output
                assert out is not None
                yield DecodeChunk(out.new_token_ids, out.finish_reason if out.finished else None,
                                  out.logprobs)
                if out.finished:
                    return
        except GeneratorExit:
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> bool:
        self.loop.close_stream(request_id)
        return self.loop.call(lambda: self.loop.engine.abort(request_id))
