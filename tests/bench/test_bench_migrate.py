"""`pdserve bench migrate` on the tiny model, one move pass: every running decode moves, no token
changes, the router times each moved stream's stall, and the JSON, table and PNG are written.
Figures here mean nothing (no stall is bounded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT

N = 8


@pytest.mark.timeout(600)
def test_bench_migrate_moves_every_decode_and_changes_no_token(tiny_llama_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "migrate", "--json", "--out", str(tmp_path),
         "--model", tiny_llama_dir, "--requests", str(N), "--max-tokens", "48", "--runs", "1"],
        capture_output=True, text=True, timeout=540, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert result["settings"]["flipped_to_decode"]
    [run] = result["runs"]
    assert run["source"] != run["target"]
    assert (run["mismatches"], run["errors"]) == (0, 0)
    assert run["in_flight_at_move"] == run["moved"] == N  # every running decode moved
    assert run["resumed_on_target"] == N
    assert run["router_stall_count"] == run["moved"]
    assert run["target_decode_steps"] > 0 and run["target_step_s"] > 0
    assert len(run["stall_s"]) == len(run["stall_steps"]) == N
    assert all(x > 0 for x in run["stall_s"] + run["stall_steps"])
    for figures in (run["stall"], run["stall_in_steps"], result["pooled"]["stall_in_steps"]):
        assert all(figures[k] > 0 for k in ("p50", "p90", "p99", "max")), figures
    assert run["ordinary_gap_s"] > 0 and run["router_stall_mean_s"] > 0
    v = result["verdict"]
    assert v["tokens_identical"] and v["no_request_lost"] and v["every_decode_moved"]
    assert v["router_counted_every_stall"]
    with open(tmp_path / "migrate.json") as fh:
        assert json.load(fh)["runs"] == result["runs"]
    assert os.path.getsize(tmp_path / "migrate.png") > 5000
    table = (tmp_path / "migrate.md").read_text()
    assert "stall in target steps" in table
    assert "tokens identical to the fault-free run: met" in table


@pytest.mark.parametrize("flags, says", [
    (["--requests", "0"], "--requests must be >= 1, got 0"),
    (["--move-after-tokens", "0"], "--move-after-tokens must be >= 1, got 0"),
    (["--runs", "0"], "--runs must be >= 1, got 0"),
    (["--max-tokens", "16"], "--max-tokens must exceed --move-after-tokens"),
])
def test_bench_migrate_refuses_bad_flags_naming_them(flags, says):
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "migrate", *flags],
                         capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2 and says in out.stderr, out.stderr
