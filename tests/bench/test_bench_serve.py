"""`pdserve bench serve`: a short real run on the tiny model (a cluster with internal TLS and one
without, its HTTP API, the engine ceiling, the per-hop fields), bad flags, and the summary math
as pure functions. Figures of the tiny model mean nothing; only what a user reads from the
document is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.bench import serve_summary as ss
from pdserve.bench import serve_tls as st
from pdserve.bench import serve_workload as wl
from tests.helpers import REPO_ROOT

BENCH = [sys.executable, "-m", "pdserve.bench.serve"]


@pytest.mark.scenario  # a whole bench run: with the long scenarios (.ci/scenarios)
@pytest.mark.timeout(240)
def test_bench_serve_real_run_json_and_png(tiny_llama_dir, tmp_path):
    """With `--internal-tls both --tls-pairs 1`: a pass with TLS (the figures below), then one
    without; the TLS checks are at the end."""
    out = subprocess.run(
        [*BENCH, "--model", tiny_llama_dir, "--requests", "4", "--concurrency", "1,2",
         "--max-tokens", "8", "--ceiling-repeats", "1", "--json", "--out", str(tmp_path),
         "--internal-tls", "both", "--tls-pairs", "1",
         "--no-progress"], capture_output=True, text=True, timeout=220, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["bench"] == "serve" and r["workload"]["source"] == "sharegpt"
    assert r["workload"]["requests"] == 4 and r["workload"]["prompt_tokens_min"] > 0
    levels = r["pdserve"]["levels"]
    assert [lv["concurrency"] for lv in levels] == [1, 2]
    for lv in levels:
        # Every request completed with exactly its 8 tokens (ignore_eos), none failed.
        assert (lv["requests"], lv["ok"], lv["failed"], lv["errors"]) == (4, 4, 0, [])
        assert lv["output_tokens"] == 4 * 8 and lv["tokens_per_s"] > 0
        assert 0 < lv["ttft_p50_s"] <= lv["ttft_p90_s"]
        assert 0 <= lv["itl_p50_s"] <= lv["itl_p90_s"] and lv["tpot_mean_s"] > 0
        h = lv["hops"]
        assert [x["hop"] for x in h["hops"]] == ["engine step", "worker -> router",
                                                  "router -> client"]
        assert h["engine_step_s"] > 0 and h["router_itl_mean_s"] > 0
        assert all(x["seconds"] is not None for x in h["hops"])
        assert h["decode_engine_busy_s"] > 0
        # The engine step and the worker -> router trip come from the processes' histograms;
        # only the router -> client hop is still a difference of means.
        assert [x["source"] for x in h["hops"][:2]] == [
            "/metrics pdserve:decode_step_seconds", "/metrics pdserve:worker_to_router_seconds"]
        assert h["missing"] == [ss.MISSING["router_to_client"]]
        assert 0 <= h["hops"][1]["seconds"] < 1.0  # a loopback hop
        # The scrapes' differences: this level's 4 requests and 32 tokens at the router.
        router = lv["metrics_diff"]["router"]
        assert router["pdserve:generation_tokens_total"] == 32
        assert router["pdserve:time_to_first_token_seconds_count"] == 4
        assert router["pdserve:worker_to_router_seconds_count"] >= 4  # a message per request
        steps = sum(w["metrics"].get("pdserve:decode_step_seconds_count", 0)
                    for w in lv["metrics_diff"]["workers"])
        assert steps >= 7  # 8 tokens each: the first from prefill, then at least 7 steps
        # CPU seconds of every process of the cluster and of the bench's client; the decode
        # worker computed this level's steps, so it spent some.
        cpu = lv["cpu_s"]
        assert set(cpu) == {"client", "router", "kvmaster", "kvnode-0", "prefill-0",
                            "decode-1", "controller"}
        assert cpu["decode-1"] > 0 and cpu["client"] > 0
    eng = r["engine"]
    # The ceiling runs on the most threads a decode step may take: every core while the
    # workers lend each other idle ones (the default), else the worker's own share.
    cfg = r["pdserve"]["config"]
    assert cfg["share_cores"] is True and cfg["threads_per_worker"] >= 1
    assert eng["threads"] == cfg["max_threads"] == max(cfg["threads_per_worker"],
                                                       len(os.sched_getaffinity(0)))
    assert [e["batch_size"] for e in eng["levels"]] == [1, 2]
    assert all(e["tokens_per_s"] > 0 and e["step_s"] > 0 for e in eng["levels"])
    assert [c["concurrency"] for c in r["comparison"]] == [1, 2]
    assert all(c["serving_over_engine"] > 0 for c in r["comparison"])
    assert r["baselines"] == {}
    with open(tmp_path / "summary.json") as f:
        assert json.load(f) == r
    assert os.path.getsize(tmp_path / "bench_serve.png") > 5000
    _check_internal_tls(r)


def _check_internal_tls(r):
    t = r["internal_tls"]
    assert (t["mode"], t["order"]) == ("both", ["on", "off"])
    on, off = t["passes"]
    assert r["pdserve"]["mode"] == "on" and r["pdserve"]["levels"][0]["concurrency"] == 1
    # Every process of the TLS pass ran with the run's TLS folder, as the system reports its
    # command line; every process of the other with --insecure-internal.
    names = {"router", "kvmaster", "kvnode-0", "prefill-0", "decode-1", "controller"}
    assert set(on["flags"]) == set(off["flags"]) == names
    assert all(f == ["--tls-dir", t["tls_dir"]] for f in on["flags"].values()), on["flags"]
    assert all(f == ["--insecure-internal"] for f in off["flags"].values()), off["flags"]
    assert os.path.isfile(os.path.join(t["tls_dir"], "ca.crt"))
    # The worker -> router hop (a gRPC stream, in TLS or not) per pass and level.
    assert all(lv["worker_to_router_s"] is not None for p in t["passes"] for lv in p["levels"])
    rows = t["by_level"]
    assert [row["concurrency"] for row in rows] == [1, 2]
    for row in rows:
        for mode in ("on", "off"):
            m = row[mode]
            assert m["passes"] == 1 and m["failed"] == 0 and m["tokens_per_s"] > 0
            assert m["cpu_s_per_token"] > 0
        assert row["tokens_ratio"] == pytest.approx(row["on"]["tokens_per_s"] /
                                                    row["off"]["tokens_per_s"])
        assert row["pair_ratios"] == [pytest.approx(row["tokens_ratio"])]
        assert row["cpu_per_token_ratio"] == pytest.approx(row["on"]["cpu_s_per_token"] /
                                                           row["off"]["cpu_s_per_token"])
    aim = t["aim"]  # no c32 level here: judged at the highest, and it says so
    assert aim["concurrency"] == 2 and "no concurrency 32" in aim["note"]
    assert aim["met"] is (aim["ratio"] >= 0.97)


@pytest.mark.parametrize("flags, message", [
    (["--concurrency", "1,0"], "--concurrency"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--trace", "/nonexistent/trace.jsonl"], "--trace"),
    (["--vllm-python", "/nonexistent/python"], "--vllm-python"),
    (["--quantization", "int4"], "--quantization"),
    (["--internal-tls", "sometimes"], "--internal-tls"),
    (["--internal-tls", "both", "--tls-pairs", "0"], "--tls-pairs"),
])
def test_bench_serve_bad_flag_names_it(flags, message):
    out = subprocess.run([*BENCH, *flags], capture_output=True, text=True, timeout=120,
                         cwd=REPO_ROOT)
    assert out.returncode == 2 and message in out.stderr, out.stderr[-2000:]


# ---- the summary math ------------------------------------------------------------------------
def test_tls_passes_alternate_and_compare_per_level():
    assert st.pass_order("on", 2) == ["on"] and st.pass_order("off", 3) == ["off"]
    assert st.pass_order("both", 3) == ["on", "off", "off", "on", "on", "off"]
    assert st.cluster_setting("off", "/x") == {"insecure_internal": True}
    assert st.cluster_setting("on", "/x") == {"tls_dir": "/x"}
    assert st.cluster_setting("on", None) == {}
    assert st.tls_flags(["py", "-m", "a", "--tls-dir", "/d", "--x"]) == ["--tls-dir", "/d"]
    assert st.tls_flags(["py", "--insecure-internal"]) == ["--insecure-internal"]

    def lv(c, tps, cpu):
        return {"concurrency": c, "tokens_per_s": tps, "output_tokens": 100, "failed": 0,
                "itl_p50_s": 0.01, "ttft_p50_s": 0.1, "cpu_s": {"router": cpu, "client": 1.0}}
    passes = [{"mode": "on", "levels": [lv(32, 90.0, 2.0)]},
              {"mode": "off", "levels": [lv(32, 100.0, 1.0)]},
              {"mode": "off", "levels": [lv(32, 110.0, 1.0)]},
              {"mode": "on", "levels": [lv(32, 110.0, 2.0)]}]
    [row] = st.compare(passes)
    assert row["on"]["tokens_per_s"] == 100.0 and row["off"]["tokens_per_s"] == 105.0
    assert row["tokens_ratio"] == pytest.approx(100 / 105)
    assert row["pair_ratios"] == [pytest.approx(0.9), pytest.approx(1.0)]
    assert row["on"]["cpu_s_per_token"] == pytest.approx(0.02)  # the client left out
    assert row["on"]["client_cpu_s_per_token"] == pytest.approx(0.01)
    assert row["cpu_per_token_ratio"] == pytest.approx(2.0)


def test_percentile_interpolates_as_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert ss.percentile(xs, 0) == 1.0 and ss.percentile(xs, 100) == 4.0
    assert ss.percentile(xs, 50) == pytest.approx(2.5)
    assert ss.percentile(xs, 90) == pytest.approx(3.7)
    assert ss.percentile([], 50) is None
    with pytest.raises(ValueError, match="q must be"):
        ss.percentile(xs, 101)


def _row(ttft, times, tokens, expected=4, error=None, e2e=1.0):
    return {"error": error, "output_tokens": tokens, "expected_tokens": expected,
            "ttft_s": ttft, "chunk_times_s": times, "e2e_s": e2e}


def test_level_figures_counts_only_complete_requests():
    rows = [_row(0.1, [0.1, 0.2, 0.3, 0.4], 4),
            _row(0.2, [0.2, 0.4, 0.6, 0.8], 4),
            _row(0.3, [0.3, 0.4], 2),  # fewer tokens than asked: failed
            _row(None, [], 0, error="HTTP 429: busy")]
    f = ss.level_figures(rows, wall_s=2.0)
    assert (f["requests"], f["ok"], f["failed"]) == (4, 2, 2)
    assert f["output_tokens"] == 8 and f["tokens_per_s"] == pytest.approx(4.0)
    assert f["ttft_p50_s"] == pytest.approx(0.15)
    assert f["itl_p50_s"] == pytest.approx(0.15)  # gaps 0.1 x3 and 0.2 x3
    assert f["tpot_mean_s"] == pytest.approx(0.15)
    assert f["tokens_per_chunk"] == 1.0
    assert f["errors"] == [{"error": "2 of 4 tokens", "count": 1},
                           {"error": "HTTP 429: busy", "count": 1}]
    with pytest.raises(ValueError, match="wall_s"):
        ss.level_figures(rows, 0.0)


PROM = """# TYPE pdserve:inter_token_latency_seconds histogram
pdserve:inter_token_latency_seconds_bucket{le="0.1",model_name="m"} 3.0
pdserve:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 4.0
pdserve:inter_token_latency_seconds_count{model_name="m"} 4.0
pdserve:inter_token_latency_seconds_sum{model_name="m"} 0.5
# TYPE pdserve:engine_busy_seconds counter
pdserve:engine_busy_seconds_total{model_name="m"} 2.5
"""


def test_sample_totals_and_diff():
    t = ss.sample_totals(PROM)
    assert t == {"pdserve:inter_token_latency_seconds_count": 4.0,
                 "pdserve:inter_token_latency_seconds_sum": 0.5,
                 "pdserve:engine_busy_seconds_total": 2.5}
    assert ss.diff({"a": 1.0}, {"a": 3.0, "b": 2.0}) == {"a": 2.0, "b": 2.0}


def test_hop_breakdown_from_metric_differences():
    router = {ss.ROUTER_ITL + "_sum": 1.2, ss.ROUTER_ITL + "_count": 40.0,
              ss.ROUTER_TTFT + "_sum": 0.8, ss.ROUTER_TTFT + "_count": 4.0}
    workers = [{"role": "prefill", "metrics": {ss.ENGINE_BUSY: 0.4}, "stats": {
                   "decode_steps": 0, "decode_step_seconds": 0.0}},
               {"role": "decode", "metrics": {ss.ENGINE_BUSY: 1.0}, "stats": {
                   "decode_steps": 40, "decode_step_seconds": 1.0}}]
    client = {"wall_s": 2.0, "tpot_mean_s": 0.035, "ttft_mean_s": 0.25}
    h = ss.hop_breakdown(router, workers, client)
    secs = {x["hop"]: x["seconds"] for x in h["hops"]}
    assert secs["engine step"] == pytest.approx(0.025)
    assert secs["worker -> router"] == pytest.approx(0.005)  # 30 ms router ITL - 25 ms step
    assert secs["router -> client"] == pytest.approx(0.005)  # 35 ms TPOT - 30 ms
    assert h["router_ttft_mean_s"] == pytest.approx(0.2)
    assert h["decode_engine_busy_fraction"] == pytest.approx(0.5)
    assert ss.MISSING["engine_step"] in h["missing"]
    # A decode-step histogram on /metrics, once a worker exports one, is used instead.
    workers[1]["metrics"].update({ss.ENGINE_STEP + "_sum": 0.8, ss.ENGINE_STEP + "_count": 40})
    h = ss.hop_breakdown(router, workers, client)
    assert h["engine_step_s"] == pytest.approx(0.02)
    assert ss.MISSING["engine_step"] not in h["missing"]
    # The router's histogram of the worker -> router trip, when it has one, times that hop.
    router.update({ss.WORKER_HOP + "_sum": 0.04, ss.WORKER_HOP + "_count": 20.0})
    h = ss.hop_breakdown(router, workers, client)
    assert {x["hop"]: x["seconds"] for x in h["hops"]}["worker -> router"] == pytest.approx(0.002)
    assert ss.MISSING["worker_to_router"] not in h["missing"]
    # No worker stats and no histogram: the hop is None, never a made-up number.
    h = ss.hop_breakdown({}, [{"role": "decode", "metrics": {}, "stats": None}], client)
    assert h["engine_step_s"] is None and all(x["seconds"] is None for x in h["hops"])


def test_engine_rate_and_comparison():
    e = ss.engine_rate(8, 64, [2.0, 1.0, 3.0])
    assert e["median_s"] == 2.0 and e["tokens_per_s"] == 256.0 and e["step_s"] == 2.0 / 64
    levels = [{"concurrency": 8, "batch_size": 8, "tokens_per_s": 128.0, "itl_p50_s": 0.0625}]
    [row] = ss.comparison(levels, {8: e}, {"vllm": [{"concurrency": 8, "tokens_per_s": 64.0}]})
    assert row["serving_over_engine"] == 0.5 and row["itl_p50_over_engine_step"] == 2.0
    assert row["vllm_tokens_per_s"] == 64.0 and row["pdserve_over_vllm"] == 2.0


def test_trace_requests_keep_shared_prefixes_and_scale(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 2000, "input_length": 1024, "output_length": 500, "hash_ids": [1, 3]},
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
    ]) + "\n")
    reqs = wl.trace_requests(str(path), 2, 64, token_scale=32, speedup=2.0, vocab=(10, 100),
                             max_prompt_tokens=4096)
    a, b = reqs  # timestamp order
    assert (a.arrival_s, b.arrival_s) == (0.0, 1.0)
    assert (a.max_tokens, b.max_tokens) == (5, 64)
    pa, pb = a.body["prompt"], b.body["prompt"]
    assert (len(pa), len(pb)) == (19, 32)  # ceil(600 / 32), 1024 / 32
    assert pa[:16] == pb[:16] and pa[16:] != pb[16:19]  # hash id 1 shared, then 2 vs 3
    assert all(10 <= t < 100 for t in pa + pb)
    assert a.path == "/v1/completions" and a.body["ignore_eos"] and a.body["temperature"] == 0
    with pytest.raises(wl.WorkloadError, match="--token-scale"):
        wl.trace_requests(str(path), 2, 64, token_scale=7, speedup=1.0, vocab=(10, 100),
                          max_prompt_tokens=64)


def test_status_lines_print_each_step_and_throttle_within_one():
    import io

    from rich.console import Console

    from pdserve.bench.serve import StatusLines

    buf, now = io.StringIO(), [0.0]
    ui = StatusLines(Console(file=buf, width=200), every_s=10.0, clock=lambda: now[0])
    for t, what, done in [(0, "starting vllm (0 s): loading", 0), (1, "starting vllm (1 s): x", 0),
                          (11, "starting vllm (11 s): y", 0), (12, "vllm: concurrency 1", 0),
                          (13, "vllm: concurrency 1", 5), (25, "vllm: concurrency 1", 9)]:
        now[0] = t
        ui(what, done, 32)
    assert [line.split("] ", 1)[1] for line in buf.getvalue().splitlines()] == [
        "starting vllm (0 s): loading (0/32)", "starting vllm (11 s): y (0/32)",
        "vllm: concurrency 1 (0/32)", "vllm: concurrency 1 (9/32)"]


def test_llamacpp_requests_ban_eos_and_its_server_is_started_without_interrupting():
    """llama.cpp's server has no ignore_eos and by default cuts a stream short when the next
    request arrives: its requests ban the EOS ids instead, and it is started without
    interrupting (measured against a real llama-cpp-python server: every request of a
    concurrency-4 level then completes with all its tokens)."""
    from pdserve.bench.serve_baseline import llamacpp_argv, without_eos

    reqs = wl.sharegpt_requests(3, 64)
    out = without_eos(reqs, (0, 2))
    assert [r.body["logit_bias"] for r in out] == [{"0": -100.0, "2": -100.0}] * 3
    assert all(o.body["messages"] == r.body["messages"] and o.body["max_tokens"] == 64
               and "logit_bias" not in r.body for o, r in zip(out, reqs))
    argv = llamacpp_argv("py", "m.gguf", 1234, "m", 2, 4096)
    assert argv[argv.index("--interrupt_requests") + 1] == "False"
