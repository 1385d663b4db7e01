"""Fixtures that start real clusters (store, workers, router as processes on loopback)."""

from __future__ import annotations

import pytest

from pdserve.controller.launcher import ClusterSpec, LocalCluster
from tests.helpers import free_port


def cluster_spec(model_path: str, **overrides) -> ClusterSpec:
    n = overrides.get("prefill_workers", 1) + overrides.get("decode_workers", 1)
    defaults = dict(router_port=free_port(), store_port=free_port(), http_port=0,
                    worker_ports=tuple(free_port() for _ in range(n)), num_blocks=256,
                    store_capacity_bytes=512 << 20, ready_timeout_s=180.0)
    return ClusterSpec(model_path=model_path, **{**defaults, **overrides})


@pytest.fixture(scope="session")
def tiny_cluster(tiny_llama_dir):
    with LocalCluster(cluster_spec(tiny_llama_dir)) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def smollm2_cluster(smollm2_gguf_path):
    with LocalCluster(cluster_spec(smollm2_gguf_path)) as cluster:
        yield cluster
