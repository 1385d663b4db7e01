"""Emulated workers behind the real router and store: a load tool's contract.

An emulated worker runs the real worker (gRPC API, scheduler, block pool, store puts and gets)
with each step timed by a profile and deterministic tokens (`engine/emulated.token_of`): a
client computes what it must receive, greedy or seeded, for one choice or several, streamed
over gRPC or HTTP, and the prompt's KV blocks go through the store at the profile's size
scaled by `kv_scale`. The worker processes load no torch.
"""

from __future__ import annotations

import httpx
import pytest

from pdserve import rpc
from pdserve.core.step_profile import load_profile
from pdserve.engine.checkpoint_config import load_model_config
from pdserve.engine.emulated import kv_block_bytes, token_of
from pdserve.core.identity import MASTER
from pdserve.launcher.local import LocalCluster
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import kvmaster_pb2 as mpb
from pdserve.proto import kvmaster_pb2_grpc as mpb_grpc
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import worker_stats, workers

PROFILE = "h100-llama3-8b"
KV_SCALE = 1 / 256  # 8 KiB blocks: whole pages, as the store allocates


@pytest.fixture(scope="module")
def emulated(smollm2_gguf_path):
    spec = cluster_spec(smollm2_gguf_path, engine="emulated", profile=PROFILE, kv_scale=KV_SCALE)
    with LocalCluster(spec) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def expected(smollm2_gguf_path):
    config = load_model_config(smollm2_gguf_path)

    def tokens(rid: str, n: int, seed: int | None = None) -> list[int]:
        return [token_of(rid, i, seed, config.vocab_size, frozenset(config.eos_token_ids))
                for i in range(n)]
    return tokens


def _generate(cluster, rid: str, prompt: str, n: int = 1, **sampling) -> dict[int, list[int]]:
    req = api_pb2.GenerateRequest(request_id=rid, prompt=prompt, n=n,
                                  sampling=common_pb2.SamplingParams(**sampling))
    out: dict[int, list[int]] = {}
    with rpc.make_channel(cluster.router_address, rpc.PUBLIC) as ch:
        for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120):
            assert r.request_id == rid
            out.setdefault(r.index, []).extend(r.token_ids)
    return out


def test_greedy_and_seeded_tokens_are_the_emulated_models(emulated, expected):
    prompt = "An emulated worker answers this prompt " * 8  # several KV blocks
    assert _generate(emulated, "emu-greedy", prompt, max_tokens=24) == {
        0: expected("emu-greedy", 24)}
    assert _generate(emulated, "emu-seeded", prompt, max_tokens=10, temperature=0.8,
                     seed=7) == {0: expected("emu-seeded", 10, seed=7)}
    # A choice of several is the request `rid.i`, seeded seed + i.
    assert _generate(emulated, "emu-n", prompt, n=3, max_tokens=5, temperature=1.0,
                     seed=40) == {i: expected(f"emu-n.{i}", 5, seed=40 + i) for i in range(3)}
    # The same id again (a client's retry) gives the same tokens.
    assert _generate(emulated, "emu-greedy", prompt, max_tokens=24) == {
        0: expected("emu-greedy", 24)}


def test_stop_rules_still_shape_the_length(emulated, expected):
    want = expected("emu-stop", 16)
    got = _generate(emulated, "emu-stop", "Stop early", max_tokens=16, stop_token_ids=[want[5]])
    assert got == {0: want[:want.index(want[5]) + 1]}


def test_the_prompts_kv_goes_through_the_store_at_the_scaled_size(emulated, smollm2_gguf_path):
    [prefill] = workers(emulated, "prefill")
    [decode] = workers(emulated, "decode")
    before = worker_stats(decode).kv_blocks_fetched
    _generate(emulated, "emu-kv", "Move this prompt's blocks " * 12, max_tokens=4)
    assert worker_stats(prefill).kv_blocks_put >= 4
    assert worker_stats(decode).kv_blocks_fetched - before >= 4
    # The store holds blocks of the emulated size: the profile's bytes per token, scaled.
    block = kv_block_bytes(load_profile(PROFILE), 16, KV_SCALE)
    with rpc.make_channel(emulated.store_address, MASTER) as ch:
        tiers = mpb_grpc.KVMasterStub(ch).Stats(mpb.MasterStatsRequest(), timeout=30).tiers
    objects = sum(t.objects for t in tiers)
    assert objects >= 4 and sum(t.used_bytes for t in tiers) == objects * block


def test_the_openai_api_serves_emulated_text(emulated, expected):
    r = httpx.post(f"http://{emulated.http_address}/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 6, "temperature": 0,
                         "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] == 6
    assert body["choices"][0]["finish_reason"] == "length"
    # Structured outputs need a model: refused, naming the field, and the server goes on.
    r = httpx.post(f"http://{emulated.http_address}/v1/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 6, "guided_regex": "[ab]+"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text


def test_emulated_workers_load_no_torch(emulated):
    """Nor numpy nor the grammar engine, after serving: a worker's memory is what hundreds of
    them on one machine multiply (KV blocks are bytes, grammars are never compiled)."""
    for child in emulated.children:
        if child.name.startswith(("prefill", "decode")):
            with open(f"/proc/{child.proc.pid}/maps") as f:
                maps = f.read()
            assert "libtorch" not in maps, child.name
            assert "/numpy/" not in maps and "/llguidance/" not in maps, child.name
