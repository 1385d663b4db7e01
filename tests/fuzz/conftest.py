"""One tiny cluster for the fuzz modules: store, one prefill and one decode worker, one router.

Started once for the package (both fuzz modules hit the same router process, so what one leaves
behind the other meets), with a small context (8 blocks of 16 tokens: 128) so that any request
the fuzzer makes valid generates little, and a small body bound (64 KiB, so the router's gRPC
receive bound is 68 KiB) so that oversized requests are cheap to send. Before any fuzzing, the
fixture records a greedy gRPC generation and an HTTP completion: `assert_still_healthy` checks
that the router still answers SERVING and gives the very same output.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc
from pdserve.launcher.local import LocalCluster
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.router.limits import grpc_receive_bytes
from tests.e2e.conftest import cluster_spec

MAX_BODY_BYTES = 64 << 10
CONTEXT_TOKENS = 8 * 16
PROMPT = "The quick brown fox"


@dataclass
class FuzzTarget:
    cluster: LocalCluster
    grpc_receive_bytes: int
    reference_ids: list[int]
    reference_text: str
    model_name: str

    @property
    def address(self) -> str:
        return self.cluster.router_address

    @property
    def http_base(self) -> str:
        return f"http://{self.cluster.http_address}"


def reference_generation(address: str) -> tuple[list[int], str]:
    req = api_pb2.GenerateRequest(prompt=PROMPT, sampling=common_pb2.SamplingParams(
        max_tokens=8, ignore_eos=True))
    with rpc.make_channel(address, rpc.PUBLIC) as ch:
        out = list(api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120))
    return [t for r in out for t in r.token_ids], "".join(r.text for r in out)


def http_reference(base: str) -> str:
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_still_healthy(target: FuzzTarget) -> None:
    with rpc.make_channel(target.address, rpc.PUBLIC) as ch:
        for service in ("", "pdserve.v1.Generation"):
            status = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service
    assert reference_generation(target.address) == (target.reference_ids,
                                                    target.reference_text)
    assert httpx.get(f"{target.http_base}/health", timeout=30).status_code == 200
    assert http_reference(target.http_base) == target.reference_text


@pytest.fixture(scope="package")
def fuzz_target(tiny_llama_dir):
    spec = cluster_spec(tiny_llama_dir, num_blocks=CONTEXT_TOKENS // 16,
                        router_settings={"http_max_body_bytes": MAX_BODY_BYTES})
    with LocalCluster(spec) as cluster:
        ids, text = reference_generation(cluster.router_address)
        assert len(ids) == 8 and text
        with rpc.make_channel(cluster.router_address, rpc.PUBLIC) as ch:
            name = api_pb2_grpc.GenerationStub(ch).ListModels(
                api_pb2.ListModelsRequest(), timeout=30).models[0].id
        target = FuzzTarget(cluster, grpc_receive_bytes(MAX_BODY_BYTES), ids, text, name)
        assert http_reference(target.http_base) == text
        yield target
