"""Progressive KV transfer between the roles, in one process over a real store (its own
process, over gRPC): the sender puts anchors before queued residuals; a decode joined on anchors
drafts, then verifies when the residuals land; residuals that never land make it recompute.
Tokens always equal the plain transfer's (invariant 3). The one fault injected is timing: a gate
in front of the store client keeps residual keys invisible until the test releases them."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from pdserve.worker.decode.role import DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.kvstore.client import KVStoreClient
from pdserve.worker.prefill.kv_sender import KvStreamSender
from pdserve.worker.prefill.role import PrefillRole
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.kv_stream import StreamHandle
from tests.conftest import make_tiny_hf_model
from tests.helpers import free_port, start_process, stop_process

MODEL = "tiny@float32"
PLAIN_MODEL = "tiny-plain@float32"  # the plain transfer's blocks never meet the stream's


@pytest.fixture(scope="module")
def store_address():
    address = f"127.0.0.1:{free_port()}"
    p = start_process([sys.executable, "-m", "pdserve.kvstore", "--address", address,
                       "--capacity-bytes", str(256 << 20)], address, timeout_s=30)
    yield address
    stop_process(p)


class GatedStore:
    """The real store client; keys for which `hide(key)` is true look absent (not yet put)."""

    def __init__(self, address: str) -> None:
        self.client = KVStoreClient(address, timeout_s=10)
        self.hide = lambda key: False

    def batch_put_from(self, items):
        return self.client.batch_put_from(items)

    def exists(self, keys):
        return [ok and not self.hide(k) for k, ok in zip(keys, self.client.exists(keys))]

    def longest_prefix(self, keys) -> int:
        n = self.client.longest_prefix(keys)
        return next((i for i in range(n) if self.hide(keys[i])), n)

    def get_into(self, key: str, buf) -> int:
        if self.hide(key):
            raise KeyError(key)
        return self.client.get_into(key, buf)

    def readers(self, keys):
        return [lambda buf, key=key: self.get_into(key, buf) for key in keys]

    def close(self) -> None:
        self.client.close()


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_progressive_roles"), "llama")


def make_loop(path: str) -> EngineLoop:
    return EngineLoop(LLMEngine(EngineConfig(
        path, cache=CacheConfig(block_size_tokens=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=8)))).start()


def run_decode(role: DecodeRole, rid, prompt, res, params, stream=None) -> list[int]:
    out = [res.first_token]
    for c in role.decode(rid, prompt, res.first_token, params, res.block_hashes, res.keys, "",
                         lambda: True, stream):
        out.extend(c.token_ids)
    return out


def handle(res, engine) -> StreamHandle:
    return StreamHandle(MODEL, res.stream_id, tuple(res.spans),
                        engine.model_config.num_hidden_layers, "float32")


PROMPTS = [[(5 * i + 7) % 300 + 3 for i in range(21)],  # 3 chunks of 8 tokens or less
           [(11 * i + 1) % 400 + 3 for i in range(19)]]
PARAMS = [SamplingParams(max_tokens=12, ignore_eos=True),
          SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)]


def test_sender_puts_anchors_before_queued_residuals(store_address):
    class Engine:
        def read_layer_kv(self, rid, layer, start, end):
            return torch.randn(end - start, 2, 8), torch.randn(end - start, 2, 8)

    store = GatedStore(store_address)
    sender = KvStreamSender(Engine(), store)
    sender.put_order = []
    for rid in ("a", "b"):
        sender.register(rid, MODEL, rid)
    for layer in range(3):  # queued before the thread starts: the order is fixed
        sender.on_layer(layer, [("a", 0, 5), ("b", 0, 7)])
    sender.on_layer(0, [("a", 5, 9)])
    sender.start()
    deadline = time.monotonic() + 10
    while sender.layers_put < 7 and time.monotonic() < deadline:
        time.sleep(0.01)
    sender.stop()
    store.close()
    kinds = [k.rsplit("/", 1)[1] for k in sender.put_order]
    assert kinds == ["anchor"] * 7 + ["residual"] * 7
    assert sender.finish("a") == [(0, 5), (5, 9)] and sender.finish("b") == [(0, 7)]


def test_sender_over_its_bound_falls_back_without_blocking(store_address):
    class Engine:
        def read_layer_kv(self, rid, layer, start, end):
            return torch.zeros(end - start, 2, 8), torch.zeros(end - start, 2, 8)

    sender = KvStreamSender(Engine(), GatedStore(store_address), max_queue_bytes=1000)
    sender.register("a", MODEL, "a")
    sender.on_layer(0, [("a", 0, 4)])  # 512 bytes: queued
    sender.on_layer(1, [("a", 0, 4)])  # 1024: over the bound, the request stops streaming
    assert sender.finish("a") is None and sender.fallbacks == 1


@pytest.mark.parametrize("residuals", ["late", "never"])
def test_anchor_join_then_exact_or_recompute_gives_the_same_tokens(llama_dir, store_address,
                                                                    residuals):
    store = GatedStore(store_address)
    p_loop, d_loop, base_loop = make_loop(llama_dir), make_loop(llama_dir), make_loop(llama_dir)
    try:
        sender = KvStreamSender(p_loop.engine, store).start()
        prefill = PrefillRole(p_loop, store, MODEL, sender=sender)
        plain_prefill = PrefillRole(base_loop, store, f"{PLAIN_MODEL}-{residuals}")
        plain_decode = DecodeRole(base_loop, store)
        decode = DecodeRole(d_loop, store, poll_s=0.01, stream_wait_s=3.0)
        layers = p_loop.engine.model_config.num_hidden_layers
        pairs = 0
        for i, (PROMPT, params) in enumerate(zip(PROMPTS, PARAMS)):
            want = run_decode(plain_decode, f"p{i}", PROMPT,
                              plain_prefill.prefill(f"p{i}", PROMPT, params), params)
            res = prefill.prefill(f"r{i}", PROMPT, params)
            assert res.stream_id and res.spans[0][0] == 0 and res.spans[-1][1] == len(PROMPT)
            assert len(res.spans) >= 3
            pairs += len(res.spans) * layers
            deadline = time.monotonic() + 10
            while sender.layers_put < pairs and time.monotonic() < deadline:
                time.sleep(0.01)  # every plane of this request is in the store
            gate = threading.Event()
            store.hide = lambda key: key.endswith("/residual") and not gate.is_set()
            engine = d_loop.engine

            def release():
                while time.monotonic() < deadline:  # drafts made on the anchors, then exact KV
                    seq = d_loop.call(lambda: engine.seqs.get(f"r{i}"))
                    if seq is not None and seq.paused:
                        break
                    time.sleep(0.01)
                if residuals == "late":
                    gate.set()

            t = threading.Thread(target=release)
            t.start()
            got = run_decode(decode, f"r{i}", PROMPT, res, params, handle(res, p_loop.engine))
            t.join()
            store.hide = lambda key: False
            assert got == want
        stats = d_loop.call(d_loop.engine.stats)
        assert decode.progressive_requests == 2 and decode.progressive_anchor_joins == 2
        if residuals == "late":
            assert decode.progressive_fallbacks == 0
            assert stats["anchor_num_drafts"] == 2 and stats["anchor_num_draft_tokens"] > 0
        else:
            assert decode.progressive_fallbacks == 2 and stats["anchor_num_drafts"] == 0
        # Every (span, layer) pair was put; no whole block (no prefix was cached remotely).
        assert sender.put_failures == 0 and prefill.blocks_put == 0
    finally:
        sender.stop()
        for loop in (p_loop, d_loop, base_loop):
            loop.stop()
        store.close()
