"""The simulator's memory stays small per request and per block, and keeping it small changes no
decision: a tiled trace is held as columns, a run keeps tens of bytes per request, a saturated
pool's queue a few hundred, a block pool a few bytes per block, and the queue kept outside the
scheduler (and hashes forgotten in it) leaves every report byte-identical."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

import pytest

from pdserve.core.step_profile import load_profile
from pdserve.sim.cluster import Cluster
from pdserve.sim.config import SimConfig
from pdserve.sim.run import simulate
from pdserve.sim.trace import for_cluster, load_trace, tile

DATA = Path(__file__).parent / "data"
H100 = load_profile("h100-llama3-8b")
MOONCAKE = load_trace(DATA / "mooncake_head60.jsonl")


def _retained_and_peak(make, cfg: SimConfig) -> tuple[int, int, int]:
    """(requests, bytes still held after the run, peak bytes) of building the trace with
    `make()` and simulating it: what is held after is the report and the trace."""
    tracemalloc.start()
    try:
        reqs = make()
        report = simulate(cfg, reqs, H100)
        gc.collect()  # the run's cycles, collected lazily while it ran
        held, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert report.summary()["finished"] == len(reqs)
    return len(reqs), held, peak


def test_a_tiled_trace_reads_as_the_list_tile_makes():
    lazy = for_cluster(MOONCAKE, workers=40, workers_per_copy=8, duration_s=50, seed=2)
    eager = tile(MOONCAKE, duration_s=50, copies=5, seed=2)
    assert list(lazy) == eager and len(lazy) == len(eager)
    assert lazy[-1] == eager[-1] and lazy[3:7] == eager[3:7]


@pytest.mark.scenario  # large simulated runs: with the long scenarios (.ci/scenarios)
def test_a_run_keeps_tens_of_bytes_per_request():
    """Records and trace columns, not an object per request: 4 times the requests on the
    same cluster add less than 200 bytes for each request added (a `SimRequest` with its
    prefix ids alone took about a kilobyte)."""
    cfg = SimConfig(prefill_workers=4, decode_workers=4, block_size=64, seed=0)
    simulate(cfg, for_cluster(MOONCAKE, workers=64, workers_per_copy=4, duration_s=15), H100)
    small = _retained_and_peak(
        lambda: for_cluster(MOONCAKE, workers=8, workers_per_copy=4, duration_s=15), cfg)
    large = _retained_and_peak(
        lambda: for_cluster(MOONCAKE, workers=64, workers_per_copy=4, duration_s=15), cfg)
    added = large[0] - small[0]
    assert added > 500
    assert (large[1] - small[1]) / added < 200


@pytest.mark.scenario  # large simulated runs: with the long scenarios (.ci/scenarios)
def test_a_saturated_pools_queue_costs_hundreds_of_bytes_per_request():
    """One prefill worker for many long prompts: nearly every request waits in its queue.
    Twice the requests raise the peak by less than 2 kB for each one added, where a queued
    prompt's tokens and a hash per 16-token block took over 20 kB. (Caches and the store small
    enough to fill in both runs, and a batch of at most 8 so that the scheduler's own queue
    is full in both: what grows is the backlog.)"""
    cfg = SimConfig(prefill_workers=1, decode_workers=3, block_size=16, kv_blocks=12_000,
                    store_capacity_blocks=12_000, max_num_seqs=8, seed=0)
    small = _retained_and_peak(
        lambda: for_cluster(MOONCAKE, workers=8, workers_per_copy=2, duration_s=12), cfg)
    large = _retained_and_peak(
        lambda: for_cluster(MOONCAKE, workers=16, workers_per_copy=2, duration_s=12), cfg)
    added = large[0] - small[0]
    assert added > 100
    assert (large[2] - small[2]) / added < 2_000


def test_an_idle_block_pool_costs_a_few_bytes_per_block():
    from pdserve.engine.block_pool import BlockPool

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = BlockPool(100_000)
        per_block = (tracemalloc.get_traced_memory()[0] - before) / 100_000
    finally:
        tracemalloc.stop()
    assert pool.num_free == 100_000
    assert per_block < 32  # an ordered map of free block ids took about 150


def _run_json(cfg: SimConfig, reqs, kept_small: bool) -> str:
    c = Cluster(cfg, reqs, H100)
    if not kept_small:
        for w in c.workers.values():
            w.engine.held = w.engine.long_queue = 1 << 30
    report = c.run()
    return report.to_json()


def test_queues_kept_outside_the_scheduler_decide_the_same():
    """Prompts held back outside the scheduler and hashes forgotten while queued, on prefill
    workers and on decode workers where hand-overs join behind them, against neither: the
    same report, byte for byte."""
    for cfg, reqs in (
            (SimConfig(prefill_workers=1, decode_workers=2, max_num_seqs=2,
                       max_local_prefill_tokens=100_000, block_size=64),
             for_cluster(MOONCAKE, workers=8, workers_per_copy=2, duration_s=15, seed=1)),
            (SimConfig(prefill_workers=1, decode_workers=3, max_num_seqs=16, block_size=16,
                       seed=0),
             for_cluster(MOONCAKE, workers=8, workers_per_copy=2, duration_s=12))):
        c = Cluster(cfg, reqs, H100)
        kept = c.run().to_json()
        assert max(w.engine.backlog_peak for w in c.workers.values()) > 20  # it was used
        assert kept == _run_json(cfg, reqs, kept_small=False)
