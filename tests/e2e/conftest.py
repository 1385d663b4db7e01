"""Fixtures that start real clusters (store, workers, router as processes on loopback)."""

from __future__ import annotations

import pytest

from pdserve.launcher.local import ClusterSpec, LocalCluster
from tests.helpers import free_port


def cluster_spec(model_path: str, **overrides) -> ClusterSpec:
    n = overrides.get("prefill_workers", 1) + overrides.get("decode_workers", 1)
    defaults = dict(router_port=free_port(), store_port=free_port(), http_port=0,
                    worker_ports=tuple(free_port() for _ in range(n)), num_blocks=256,
                    store_capacity_bytes=512 << 20, ready_timeout_s=180.0,
                    # Off unless a test is about it: an acting controller would offload or flip
                    # under the load of tests that count blocks and cache hits per worker.
                    controller=False, controller_port=free_port(),
                    # Off unless a test is about it: a slow shared host would refuse requests
                    # of tests that overload on purpose for their predicted TTFT.
                    max_predicted_ttft_s=0.0,
                    # Off unless a test is about it (tests/e2e/test_local_prefill.py): a repeated
                    # prompt would skip the prefill worker whose blocks and hits tests count.
                    max_local_prefill_tokens=0)
    return ClusterSpec(model_path=model_path, **{**defaults, **overrides})


@pytest.fixture(scope="session")
def tiny_cluster(tiny_llama_dir):
    with LocalCluster(cluster_spec(tiny_llama_dir)) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def smollm2_cluster(smollm2_gguf_path):
    with LocalCluster(cluster_spec(smollm2_gguf_path)) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def client(smollm2_cluster):
    """The official `openai` client on the SmolLM2 cluster's HTTP API (no retries)."""
    import openai

    return openai.OpenAI(base_url=f"http://{smollm2_cluster.http_address}/v1", api_key="unused",
                         max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="session")
def tiny_2p2d_cluster(tiny_llama_dir):
    """2 prefill + 2 decode workers, no controller: the controller tests start their own and
    put the roles back to 2:2 when they end."""
    with LocalCluster(cluster_spec(tiny_llama_dir, prefill_workers=2, decode_workers=2,
                                   num_blocks=256)) as cluster:
        yield cluster
