"""`pdserve bench emulate` at two small sizes: the command's JSON document, its table and PNG,
and what a run must show whatever the machine: every streamed request exact, the flips done,
the killed workers out of the router's pools and back. The figures themselves mean nothing
here; docs/benchmarks.md has them at scale."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT


@pytest.mark.timeout(900)
def test_bench_emulate_json_table_and_png(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "emulate", "--json", "--out",
         str(tmp_path), "--workers", "4,8", "--load-s", "6", "--idle-s", "2", "--rate", "3"],
        capture_output=True, text=True, timeout=840, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    assert [s["workers"] for s in result["sizes"]] == [4, 8]
    for s in result["sizes"]:
        assert s["prefill"] + s["decode"] == s["workers"]
        w = s["memory"]["worker"]
        assert w["processes"] == s["workers"] and 0 < w["pss_mean_mb"] < w["mean_mb"]
        assert s["load"]["requests"] > 0 and s["load"]["correct"] == s["load"]["requests"], s
        assert s["rebalance"]["ok"] == s["rebalance"]["flips"] >= 1, s
        assert s["controller_tick"]["decide"]["count"] > 0
        assert s["kv_event_lag"] is not None and s["kv_event_lag"]["count"] > 0
        calls = s["master_calls"]  # the prefill workers put KV, the decode workers fetch it
        assert calls["per_s"] > 0 and calls["p99_le"] is not None, calls
        assert {"BatchPutStart", "BatchPutCommit", "Get"} <= set(calls["methods"]), calls
        kill = s["kill_tenth"]
        assert kill["killed"] >= 1 and kill["back_in_pools_s"] >= kill["restarted_s"] > 0
    with open(tmp_path / "emulate.json") as fh:
        assert json.load(fh)["sizes"] == result["sizes"]
    assert os.path.getsize(tmp_path / "emulate.png") > 5000
    assert "| 8 |" in (tmp_path / "emulate.md").read_text()


def test_bench_emulate_refuses_a_size_too_small():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "emulate", "--workers",
                          "2"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode != 0 and "--workers: each size must be >= 4" in out.stderr
