"""`pdserve bench route` on a small trace with shared prefixes: the document's fields and
arithmetic, and KV-aware routing keeping conversations on the worker that caches them.

The trace is written here in the Mooncake format: 7 conversations of 4 turns, each turn
repeating its conversation's earlier blocks and adding two, all starting with one block every
request shares. Seven is odd on purpose: round-robin over 2 workers then sends consecutive turns
of a conversation to alternating workers (with an even count it would keep each conversation
on one worker by accident). One cluster (`--one-cluster`), two policies, about half a minute
on 2 cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import math

import pytest

from pdserve.bench import route as bench

CONVERSATIONS, TURNS = 7, 4


def write_trace(path) -> None:
    with open(path, "w") as f:
        for turn in range(TURNS):
            for c in range(CONVERSATIONS):
                blocks = 2 * turn + 2
                ids = [0] + [1000 * (c + 1) + m for m in range(blocks)]
                rec = {"timestamp": 250 * (turn * CONVERSATIONS + c),
                       "input_length": 512 * (blocks + 1) - 100, "output_length": 10,
                       "hash_ids": ids}
                f.write(json.dumps(rec) + "\n")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("route-bench")
    trace = tmp / "trace.jsonl"
    write_trace(trace)
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = bench.main(["--json", "--out", str(tmp / "out"), "--no-progress",
                         "--trace", str(trace), "--requests", str(CONVERSATIONS * TURNS),
                         "--num-blocks", "512", "--speedup", "1",
                         "--policies", "round_robin,kv_aware", "--one-cluster"])
    assert rc == 0
    return json.loads(stdout.getvalue()), tmp / "out"


def _rate(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and 0.0 <= x <= 1.0


@pytest.mark.scenario  # a whole bench run: with the long scenarios (.ci/scenarios)
def test_document_fields_and_arithmetic(run):
    doc, out = run
    assert (out / "route.json").is_file() and (out / "route.png").stat().st_size > 0
    assert doc["scale"]["token_scale"] == 32 and doc["scale"]["scaled_block_tokens"] == 16
    assert "Apache-2.0" in doc["trace"]["attribution"]
    ideal = doc["ideal"]
    assert 0 < ideal["hit_tokens"] < ideal["prompt_tokens"]
    assert ideal["hit_rate"] == pytest.approx(ideal["hit_tokens"] / ideal["prompt_tokens"])
    lru = ideal["lru_hit_rate_by_capacity_blocks"]
    assert sorted(lru, key=int) == ["512", "1024"]  # one worker's blocks, both workers'
    assert lru["512"] <= lru["1024"] <= ideal["hit_rate"]
    assert list(doc["policies"]) == ["round_robin", "kv_aware"]
    for name, r in doc["policies"].items():
        assert r["requests"] == CONVERSATIONS * TURNS and r["errors"] == 0, r["error_examples"]
        assert r["prompt_tokens"] == ideal["prompt_tokens"]  # same structure, other tokens
        for key in ("local_hit_rate", "total_hit_rate", "local_vs_ideal"):
            assert _rate(r[key]), (name, key, r[key])
        assert r["local_hit_rate"] <= r["total_hit_rate"] <= ideal["hit_rate"] + 1e-9
        assert r["local_hit_rate"] == pytest.approx(r["local_hit_tokens"] / r["prompt_tokens"])
        assert r["local_vs_ideal"] == pytest.approx(r["local_hit_rate"] / ideal["hit_rate"])
        assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"]
        assert r["ttft_mean_s"] > 0
        assert sum(r["requests_per_worker"]) == CONVERSATIONS * TURNS
    assert doc["policies"]["round_robin"]["ttft_mean_vs_round_robin"] == pytest.approx(1.0)
    assert doc["aim"]["kv_aware_local_vs_ideal"] == doc["policies"]["kv_aware"]["local_vs_ideal"]


@pytest.mark.scenario  # a whole bench run: with the long scenarios (.ci/scenarios)
def test_kv_aware_hits_its_own_cache_at_least_as_often_as_round_robin(run):
    doc, _ = run
    kv, rr = doc["policies"]["kv_aware"], doc["policies"]["round_robin"]
    assert kv["local_hit_rate"] >= rr["local_hit_rate"]
    # With shared prefixes and little load, KV-aware keeps each conversation on one worker.
    assert kv["local_vs_ideal"] >= 0.9, kv
