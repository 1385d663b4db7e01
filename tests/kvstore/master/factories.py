"""Factories for master-core tests: a core with nodes registered, and one-call puts.

Sizes are in pages of PAGE bytes (the default allocation alignment), so used-byte arithmetic in
tests stays exact.
"""

from __future__ import annotations

import dataclasses

from pdserve.kvstore.master import MasterConfig, MasterCore, Placement, SegmentSpec

PAGE = 4096


def make_config(**overrides) -> MasterConfig:
    # Exact LRU by default (a sample window larger than any test's object count).
    return dataclasses.replace(MasterConfig(eviction_sample=1000), **overrides)


def add_node(core: MasterCore, node_id: str, dram_pages: int = 100, ssd_pages: int = 0,
             now_s: float = 0.0) -> None:
    segments = [SegmentSpec(f"{node_id}-dram", dram_pages * PAGE, "dram", f"/dev/shm/{node_id}")]
    if ssd_pages:
        segments.append(SegmentSpec(f"{node_id}-ssd", ssd_pages * PAGE, "ssd"))
    core.register_node(node_id, f"host-{node_id}", f"127.0.0.1:{7000 + len(node_id)}",
                       segments, now_s)


def make_core(nodes: int = 1, dram_pages: int = 100, ssd_pages: int = 0,
              **config_overrides) -> MasterCore:
    """A core with nodes n0..n{nodes-1}, each with `dram_pages` of DRAM (and SSD if asked),
    registered at t=0; config fields may be overridden by keyword."""
    core = MasterCore(make_config(**config_overrides))
    for i in range(nodes):
        add_node(core, f"n{i}", dram_pages, ssd_pages)
    return core


def put(core: MasterCore, key: str, pages: int = 1, now_s: float = 0.0,
        replicas: int = 1) -> list[Placement]:
    """put_start + put_commit of an object of `pages` full pages."""
    placements = core.put_start(key, pages * PAGE, 0, replicas, now_s)
    core.put_commit(key, now_s)
    return placements


def used_pages(core: MasterCore, tier: str = "dram") -> int:
    return core.stats()[tier].used_bytes // PAGE


def keys_of(core: MasterCore, keys) -> list[str]:
    """Which of `keys` are committed."""
    return [k for k, present in zip(keys, core.exists(list(keys))) if present]
