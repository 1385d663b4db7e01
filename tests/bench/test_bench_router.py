"""`pdserve bench router`: the figures' arithmetic, then one small run with two routers.

The fit recovers a known cost per request and per token from windows of two answer lengths;
the highest rate within the limits is the last window that was served and stayed within them
of the lowest rate; scaling compares N routers' best served window with N times one router's.
The run (two routers sharing the ports, both APIs) must answer every request and write its
JSON, table and PNG; its figures mean nothing here (docs/benchmarks.md has them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.bench.router import costs, per_core, scaling, summarize, within_limits
from pdserve.bench.router_client import Row
from tests.helpers import REPO_ROOT


def window(rate, ok, tokens, cpu, ttft, gap, sent=None, wall=10.0):
    return {"rate_rps": rate, "sent": ok if sent is None else sent, "dropped": 0, "ok": ok,
            "tokens": tokens, "router_cpu_s": cpu, "ttft_p99_s": ttft, "gap_p99_s": gap,
            "requests_per_s": ok / wall, "tokens_per_s": tokens / wall,
            "router_cores": cpu / wall}


def test_the_fit_recovers_a_cost_per_request_and_per_token():
    a, b = 0.004, 0.0002  # 4 ms a request, 200 us a token
    ws = [window(r, n, n * k, a * n + b * n * k, 0.03, 0.008)
          for r, n, k in ((10, 100, 1), (10, 100, 64), (20, 200, 64), (40, 400, 64))]
    c = costs(ws)
    assert c["us_per_request"] == pytest.approx(4000) and c["us_per_token"] == pytest.approx(200)
    core = per_core(c, 64)
    assert core["requests_per_s"] == pytest.approx(1 / (a + 64 * b))
    assert core["tokens_per_s"] == pytest.approx(64 / (a + 64 * b))
    assert core["tokens_per_s_tokens_only"] == pytest.approx(5000)
    # One answer length cannot tell a request's cost from its tokens'.
    assert costs([window(10, 100, 6400, 1.0, 0.03, 0.008),
                  window(20, 200, 12800, 2.0, 0.03, 0.008)]) is None


def test_the_highest_rate_within_the_limits():
    ws = [window(10, 100, 6400, 1.0, 0.030, 0.008),
          window(20, 200, 12800, 2.0, 0.039, 0.0095),  # +9 ms, +1.5 ms: within
          window(40, 400, 25600, 4.0, 0.045, 0.009),  # +15 ms TTFT: past the limit
          window(80, 700, 44800, 7.0, 0.035, 0.009, sent=800)]  # a tenth failed: not served
    best = within_limits(ws)
    assert best["rate_rps"] == 20 and best["router_cores"] == pytest.approx(0.2)
    assert best["tokens_per_s_per_core"] == pytest.approx(1280 / 0.2)
    assert best["added_ttft_p99_s"] == pytest.approx(0.009)
    assert within_limits([window(10, 50, 3200, 1.0, 0.03, 0.008, sent=100)]) is None


def test_scaling_against_n_times_one_router():
    runs = {n: {"apis": {"http": {"cost": {"us_per_token": 200.0 + n},
                                  "windows": [window(10, 100, t, 1.0, 0.03, 0.008)]}}}
            for n, t in ((1, 10_000), (2, 16_000))}
    assert scaling(runs, "http") == [
        {"routers": 1, "tokens_per_s": 1000.0, "vs_n_times_one": 1.0, "us_per_token": 201.0},
        {"routers": 2, "tokens_per_s": 1600.0, "vs_n_times_one": 0.8, "us_per_token": 202.0}]


def test_a_window_counts_answers_refusals_and_gaps():
    rows = [Row(True, "ok", 0.02, [0.008, 0.009], 3), Row(True, "ok", 0.04, [0.01], 2),
            Row(False, "429", retry_after="1"), Row(False, "UNAVAILABLE")]
    w = summarize(rows, sent=4, dropped=0, wall_s=2.0, cpu_s=0.5, rate=2.0, max_tokens=3)
    assert (w["ok"], w["refused"], w["errors"], w["tokens"]) == (2, 1, ["UNAVAILABLE"], 5)
    assert w["ttft_p50_s"] == 0.04 and w["gap_p99_s"] == 0.01 and w["router_cores"] == 0.25


@pytest.mark.scenario  # a whole bench run: with the long scenarios (.ci/scenarios)
@pytest.mark.timeout(600)
def test_bench_router_with_two_routers_json_table_and_png(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "router", "--json", "--out",
         str(tmp_path), "--routers", "2", "--rates", "4,8", "--window-s", "1.5",
         "--max-tokens", "16", "--decode-workers", "2"],
        capture_output=True, text=True, timeout=540, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    [run] = result["runs"]
    assert run["routers"] == 2 and set(run["apis"]) == {"http", "grpc"}
    for api, a in run["apis"].items():
        for w in [a["short"], *a["windows"]]:
            assert w["sent"] > 0 and w["ok"] == w["sent"], (api, w)
        assert a["windows"][-1]["tokens"] == 16 * a["windows"][-1]["ok"]
        assert a["cost"]["us_per_token"] > 0, a["cost"]
    conv = run["convergence"]  # a move reaches both routers
    assert conv["moves"] == 20 and 0 < conv["p50_s"] <= conv["max_s"] < 10
    with open(tmp_path / "router.json") as fh:
        assert json.load(fh)["runs"] == result["runs"]
    assert os.path.getsize(tmp_path / "router.png") > 5000
    assert "| 2 | grpc |" in (tmp_path / "router.md").read_text()


def test_bench_router_refuses_rates_that_do_not_rise():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "router", "--rates",
                          "8,4"], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode != 0 and "--rates: rising request rates" in out.stderr
