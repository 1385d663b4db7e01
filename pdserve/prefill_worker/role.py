"""The prefill role: prefill a prompt, sample its first token, put its KV blocks to the store.

Owns the prefill side of the hand-over, and the store as a cluster-wide prefix cache: before
computing, the prompt's leading blocks that the store holds (written by any worker) and the local
pool does not are fetched and placed in the local prefix cache, so prefill skips them. Blocks the
store already holds are not written again. Must not decide routing.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass


from pdserve.engine.block_pool import prompt_block_hashes
from pdserve.engine.sampling import SamplingParams, TokenLogprobs
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.kv_blocks import block_key, block_to_buffer, fetch_run


@dataclass
class PrefillResult:
    first_token: int
    finish_reason: str | None
    block_hashes: list[bytes]
    keys: list[str]
    num_tokens: int
    num_cached_tokens: int
    first_logprobs: TokenLogprobs | None = None  # when the request asked for logprobs


class PrefillRole:
    def __init__(self, loop: EngineLoop, store, model_id: str,
                 result_timeout_s: float = 600.0) -> None:
        self.loop = loop
        self.store = store
        self.model_id = model_id
        self.timeout_s = result_timeout_s
        self.blocks_put = 0
        self.blocks_deduped = 0
        self.blocks_from_store = 0
        self._lock = threading.Lock()

    def _fetch_cached_prefix(self, prompt_ids: list[int], salt: str) -> None:
        engine = self.loop.engine
        # Only blocks before the last prompt token can be reused (one token must be computed).
        hashes = prompt_block_hashes(prompt_ids[:-1], engine.block_size, salt)
        if not hashes:
            return
        n_local = self.loop.call(lambda: engine.cached_prefix_blocks(hashes))
        if n_local == len(hashes):
            return
        layers = engine.model_config.num_hidden_layers
        keys = [block_key(self.model_id, salt, h, layers) for h in hashes]
        n_store = self.store.longest_prefix(keys)
        blocks = fetch_run(self.store, engine, hashes[n_local:n_store], keys[n_local:n_store])
        if blocks:
            placed = self.loop.call(lambda: engine.import_cached_blocks(blocks))
            with self._lock:
                self.blocks_from_store += placed

    def prefill(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                salt: str = "") -> PrefillResult:
        engine = self.loop.engine
        self._fetch_cached_prefix(prompt_ids, salt)

        def add():
            stream = self.loop.open_stream(request_id)
            try:
                engine.add_request(request_id, prompt_ids, params, salt=salt, prefill_only=True)
            except Exception:
                self.loop.close_stream(request_id)
                raise
            return stream

        stream = self.loop.call(add)
        item = stream.get(timeout=self.timeout_s)
        self.loop.close_stream(request_id)
        if item.error is not None:
            raise item.error
        assert item.output is not None and item.kv is not None
        kv = item.kv
        layers = engine.model_config.num_hidden_layers
        keys = [block_key(self.model_id, salt, h, layers) for h in kv.block_hashes]
        present = self.store.exists(keys) if keys else []
        todo = [(k, *block_to_buffer(b)) for k, b, p in zip(keys, kv.blocks, present) if not p]
        if todo:
            self.store.batch_put_from(todo)
        with self._lock:
            self.blocks_put += len(todo)
            self.blocks_deduped += len(keys) - len(todo)
        out = item.output
        return PrefillResult(out.new_token_ids[0], out.finish_reason if out.finished else None,
                             kv.block_hashes, keys, kv.num_tokens, out.num_cached_tokens,
                             out.logprobs[0] if out.logprobs else None)



