"""`pdserve bench serve --workload structured|tools|n4`: the workloads as data, the figures and
the report from hand-made passes, the streaming client's tool-call chunks, bad flags, and one
short real run of `structured` on the tiny model (its figures mean nothing; what a user reads
from the document is checked against the rows it came from)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import pytest
from rich.console import Console

from pdserve.bench import serve as bench_serve
from pdserve.bench import serve_features as sf
from pdserve.bench import serve_features_report as sfr
from pdserve.bench import serve_features_summary as fsum
from pdserve.bench import serve_workload as wl
from pdserve.router.openai_controls import strict_violation
from tests.helpers import REPO_ROOT

BENCH = [sys.executable, "-m", "pdserve.bench.serve"]


# ---- the workloads --------------------------------------------------------------------------
def _base(n=2, max_tokens=8):
    return [wl.Request("/v1/chat/completions",
                       {"messages": [{"role": "user", "content": f"q{i}"}],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True}, max_tokens) for i in range(n)]


def test_structured_request_carries_one_strict_schema_that_cannot_complete_early():
    base = _base()
    reqs = [sf.with_feature("structured", r) for r in base]
    for r, b in zip(reqs, base):
        assert {k: v for k, v in r.body.items() if k != "response_format"} == b.body
        assert r.max_tokens == b.max_tokens
        js = r.body["response_format"]["json_schema"]
        assert r.body["response_format"]["type"] == "json_schema" and js["strict"] is True
        assert js["schema"] is sf.SCHEMA  # one schema for every request: compiled once
    assert strict_violation(sf.SCHEMA) is None  # the router's strict-mode rules hold
    items = sf.SCHEMA["properties"]["items"]
    # Each item holds at least its two keys, a token each: more than MAX_TOKENS tokens in all.
    assert items["minItems"] * 2 >= sf.MAX_TOKENS
    assert base[0].body.get("response_format") is None  # the plain request is untouched


def test_tools_request_forces_one_of_its_functions():
    [r] = [sf.with_feature("tools", b) for b in _base(1)]
    names = [t["function"]["name"] for t in r.body["tools"]]
    assert 2 <= len(names) <= 3 and len(set(names)) == len(names)
    assert r.body["tool_choice"] == {"type": "function", "function": {"name": sf.FORCED_TOOL}}
    assert sf.FORCED_TOOL in names
    for t in r.body["tools"]:
        assert strict_violation(t["function"]["parameters"]) is None
    forced = next(t for t in r.body["tools"] if t["function"]["name"] == sf.FORCED_TOOL)
    assert forced["function"]["parameters"]["properties"]["items"]["minItems"] == sf.MIN_ITEMS


def test_n_choices_request_expects_every_choice_tokens_and_salts_are_fresh():
    base = _base(3, max_tokens=8)
    reqs = [sf.with_feature("n4", r, n=4) for r in base]
    assert all(r.body["n"] == 4 and r.body["max_tokens"] == 8 and r.max_tokens == 32
               for r in reqs)
    with pytest.raises(ValueError, match="unknown feature"):
        sf.with_feature("beam", base[0])
    a, b = sf.salted(reqs, "x-1-c1"), sf.salted(reqs, "x-1-c32")
    salts = [r.body["cache_salt"] for r in a + b]
    assert len(set(salts)) == 6  # no request shares prompt KV with another
    assert all("cache_salt" not in r.body for r in reqs)
    assert [r.body["n"] for r in a] == [4, 4, 4] and [r.max_tokens for r in a] == [32] * 3


# ---- the figures ----------------------------------------------------------------------------
def _scrape(prefill, decode, hits, decode_role="decode"):
    def w(addr, role, computed, h):
        return {"address": addr, "role": role, "metrics": {
            fsum.COMPUTED: computed, fsum.HITS: h, fsum.QUERIES: computed + h}}
    return {"workers": [w("p", "prefill", prefill, 0.0), w("d", decode_role, decode, hits)]}


def test_worker_counters_split_by_role_and_flag_a_flip():
    c = fsum.worker_counters(_scrape(100, 5, 10), _scrape(400, 35, 250))
    assert c["prefill"]["prompt_tokens_computed"] == 300
    assert c["decode"] == {"prompt_tokens_computed": 30, "prefix_cache_hits": 240,
                           "prefix_cache_queries": 270}
    assert c["roles_changed"] == []
    c = fsum.worker_counters(_scrape(100, 5, 10), _scrape(400, 35, 250, decode_role="prefill"))
    assert c["roles_changed"] == ["d"]
    assert c["prefill"]["prompt_tokens_computed"] == 300 + 30


def _lv(c, tps, ttft, *, requests=4, counters=None, prompts=(40, 33, 16, 17)):
    return {"concurrency": c, "requests": requests, "ok": requests, "failed": 0,
            "tokens_per_s": tps, "ttft_p50_s": ttft, "ttft_mean_s": ttft + 0.001,
            "loadavg_1m_start": 0.5, "errors": [], "prompt_tokens_each": list(prompts),
            "counters": counters or {r: {"prompt_tokens_computed": 0.0,
                                         "prefix_cache_hits": 0.0,
                                         "prefix_cache_queries": 0.0}
                                     for r in fsum.ROLES} | {"roles_changed": []}}


# Per pass (variant, {c: (tokens/s, TTFT p50 s)}), in the order of pass_order(2).
PASSES = [("without", {1: (20.0, 0.100), 32: (200.0, 0.50)}),
          ("with", {1: (19.0, 0.103), 32: (170.0, 0.52)}),
          ("with", {1: (18.0, 0.108), 32: (190.0, 0.54)}),
          ("without", {1: (20.0, 0.101), 32: (200.0, 0.50)})]


def _passes():
    return [{"variant": v, "levels": [_lv(c, *x) for c, x in lv.items()]} for v, lv in PASSES]


def test_pass_order_alternates_pairs():
    assert fsum.pass_order(1) == ["without", "with"]
    assert fsum.pass_order(3) == ["without", "with", "with", "without", "without", "with"]
    with pytest.raises(ValueError):
        fsum.pass_order(0)


def test_compare_pairs_ratios_and_ttft_differences():
    rows = fsum.compare(_passes())
    assert [r["concurrency"] for r in rows] == [1, 32]
    for row in rows:
        c = row["concurrency"]
        by = {v: [x[c] for vv, x in PASSES if vv == v] for v in ("without", "with")}
        assert row["with"]["tokens_per_s"] == pytest.approx(
            sum(t for t, _ in by["with"]) / 2)
        assert row["without"]["ttft_p50_s_each"] == [t for _, t in by["without"]]
        # Pair 1 is passes 1-2, pair 2 passes 3-4 (with first): each ratio within its pair.
        pairs = [(PASSES[1][1][c], PASSES[0][1][c]), (PASSES[2][1][c], PASSES[3][1][c])]
        ratios = [w[0] / wo[0] for w, wo in pairs]
        diffs = [w[1] - wo[1] for w, wo in pairs]
        tr = row["tokens_ratio"]
        assert tr["each"] == pytest.approx(ratios)
        assert tr["mean"] == pytest.approx(math.sqrt(ratios[0] * ratios[1]))  # geometric
        assert (tr["min"], tr["max"]) == (pytest.approx(min(ratios)), pytest.approx(max(ratios)))
        assert tr["stdev"] == pytest.approx(abs(ratios[0] - ratios[1]) / math.sqrt(2))
        assert row["ttft_p50_diff_s"]["each"] == pytest.approx(diffs)
        assert row["ttft_mean_diff_s"]["mean"] == pytest.approx(sum(diffs) / 2)
        assert row["with"]["prompt_tokens_mean"] == pytest.approx(106 / 4)


def test_speed_aims_judge_c32_ratio_and_c1_ttft():
    rows = fsum.compare(_passes())
    tput, ttft = fsum.speed_aims(rows, "with")
    ratio = math.sqrt(170 / 200 * 190 / 200)
    assert tput["value"] == pytest.approx(ratio) and tput["concurrency"] == 32
    assert tput["met"] is (ratio >= fsum.AIM_TOKENS_RATIO) and tput["note"] is None
    assert tput["each"] == pytest.approx([170 / 200, 190 / 200])
    diff = ((0.103 - 0.100) + (0.108 - 0.101)) / 2  # 5 ms
    assert ttft["value"] == pytest.approx(diff) and ttft["unit"] == "s"
    assert ttft["met"] is (diff <= fsum.AIM_TTFT_DIFF_S)
    # Without a c32 level the highest is judged, and the aim says so.
    only = [r for r in rows if r["concurrency"] == 1]
    tput, _ = fsum.speed_aims(only, "with")
    assert tput["concurrency"] == 1 and "no concurrency 32" in tput["note"]


def _choice_passes(n, tails, prompts, *, follower_prefill=0, moved=0):
    """Passes whose counters a cluster would show: each n=1 request prefilled once on the
    prefill worker; with n choices, each follower computes `tail` tokens on the decode worker
    and takes the rest of its prompt from the decode worker's cache, and `moved` tokens of
    each leader's prompt are computed on the decode worker instead of the prefill worker."""
    def counters(variant):
        k = 1 if variant == "without" else n
        shift = 0 if k == 1 else moved * len(prompts)
        pre = sum(prompts) * (1 + follower_prefill * (k - 1)) - shift
        dec = sum(t * (k - 1) for t in tails) + shift
        hits = sum((L - t) * (k - 1) for L, t in zip(prompts, tails))
        return {"prefill": {"prompt_tokens_computed": pre, "prefix_cache_hits": 0.0,
                            "prefix_cache_queries": pre},
                "decode": {"prompt_tokens_computed": dec, "prefix_cache_hits": hits,
                           "prefix_cache_queries": dec + hits},
                "roles_changed": []}
    return [{"variant": v, "levels": [_lv(1, 10.0, 0.1, requests=len(prompts),
                                          counters=counters(v), prompts=prompts)]}
            for v in fsum.pass_order(1)]


def test_choices_kv_derives_prefills_tails_and_blocks_from_counters():
    B, n = 16, 4
    prompts = [40, 33, 16, 17]
    tails = [L - B * ((L - 1) // B) for L in prompts]  # the last partial block: 8, 1, 16, 1
    assert tails == [8, 1, 16, 1]
    kv = fsum.choices_kv(_choice_passes(n, tails, prompts), n, B)
    assert kv["with"]["prefill"] == kv["without"]["prefill"] == sum(prompts) / 4
    assert kv["prefill_ratio"] == 1.0 and kv["with"]["computed"] == (sum(prompts) +
                                                                      3 * sum(tails)) / 4
    assert kv["tail_tokens"] == pytest.approx(sum(tails) / 4)
    assert kv["shared_tokens"] == pytest.approx(sum(L - t for L, t in zip(prompts, tails)) / 4)
    assert kv["expected_tail_tokens"] == pytest.approx(sum(tails) / 4)
    blocks = [math.ceil(L / B) for L in prompts]  # 3, 3, 1, 2
    expected = sum((b + (n - 1)) / b for b in blocks) / len(blocks)
    assert kv["block_ratio"] == pytest.approx(expected)
    assert kv["expected_block_ratio"] == pytest.approx(expected)
    assert kv["block_ratio_pooled"] == pytest.approx(1 + 3 * 4 / sum(blocks))
    aims = fsum.choices_aims(kv)
    assert aims[0]["met"] is True and aims[1]["met"] is (expected <= fsum.AIM_BLOCK_RATIO)
    # Part of each leader's prefill moved onto the decode worker: fewer prefill-worker tokens
    # (still one prefill), and the followers' tail, counted over both roles, is unchanged.
    moved = fsum.choices_kv(_choice_passes(n, tails, prompts, moved=5), n, B)
    assert moved["prefill_ratio"] == pytest.approx((sum(prompts) / 4 - 5) / (sum(prompts) / 4))
    assert moved["tail_tokens"] == pytest.approx(kv["tail_tokens"])
    assert moved["block_ratio"] == pytest.approx(kv["block_ratio"])
    assert fsum.choices_aims(moved)[0]["met"] is True
    # Long prompts: the followers' one block each is a small share, the aim is met.
    long_prompts = [400, 333]
    long_tails = [L - B * ((L - 1) // B) for L in long_prompts]
    kv = fsum.choices_kv(_choice_passes(n, long_tails, long_prompts), n, B)
    assert kv["block_ratio"] == pytest.approx(
        sum(1 + 3 / math.ceil(L / B) for L in long_prompts) / 2)
    assert fsum.choices_aims(kv)[1]["met"] is True
    # Followers prefilled again on the prefill worker, recomputing whole prompts: both fail.
    kv = fsum.choices_kv(_choice_passes(n, [0, 0], long_prompts, follower_prefill=1), n, B)
    assert kv["prefill_ratio"] == pytest.approx(n)
    assert kv["block_ratio"] == pytest.approx(
        sum(1 + 3 * math.ceil(sum(long_prompts) / 2 / B) / math.ceil(L / B)
            for L in long_prompts) / 2)
    assert [a["met"] for a in fsum.choices_aims(kv)] == [False, False]
    with pytest.raises(ValueError):
        fsum.choices_kv(_choice_passes(n, tails, prompts), 1, B)


# ---- the report -----------------------------------------------------------------------------
def _result(workload="structured"):
    passes = _passes() if workload != "n4" else _choice_passes(4, [8, 1, 16, 1], [40, 33, 16, 17])
    rows = fsum.compare(passes)
    doc = {"bench": "serve", "model": "tiny", "workload": {
               "name": workload, "feature": sf.DESCRIPTIONS[workload], "requests": 4,
               "max_tokens": 8, "order": [p["variant"] for p in passes]},
           "machine": {"platform": "Linux", "cpu_count": 2, "loadavg_1m_start": 0.5,
                       "loadavg_1m_end": 0.7},
           "cluster": {"start_s": 7.0, "rss_bytes": 2**30}, "passes": passes,
           "by_level": rows, "notes": ["a note"], "seconds": 60.0}
    if workload == "n4":
        doc["choices"] = fsum.choices_kv(passes, 4, 16)
        doc["aims"] = fsum.choices_aims(doc["choices"])
    else:
        doc["aims"] = fsum.speed_aims(rows, "with")
    return doc


def test_report_prints_the_computed_figures_and_writes_json_and_png(tmp_path):
    r = _result()
    console = Console(record=True, width=200)
    sfr.print_tables(r, console)
    text = console.export_text()
    ratio = r["by_level"][1]["tokens_ratio"]
    assert re.search(rf"{ratio['mean']:.3f} +│ +{ratio['each'][0]:.3f}, "
                     rf"{ratio['each'][1]:.3f} ", text)
    diff = r["by_level"][0]["ttft_p50_diff_s"]
    assert re.search(rf"\{diff['mean'] * 1000:+.1f} +│ +\{diff['each'][0] * 1000:+.1f}, "
                     rf"\{diff['each'][1] * 1000:+.1f} ", text)
    assert f"{r['aims'][0]['value']:.3f}x" in text and ">= 0.90" in text and "<= 5 ms" in text
    assert "a note" in text and "passes without, with, with, without" in " ".join(text.split())
    paths = sfr.write_outputs(r, str(tmp_path))
    assert paths == [str(tmp_path / "summary.json"), str(tmp_path / "bench_serve_structured.png")]
    with open(paths[0]) as f:
        assert json.load(f) == json.loads(json.dumps(r))
    assert os.path.getsize(paths[1]) > 5000


def test_report_of_n_choices_shows_the_kv_derivation(tmp_path):
    r = _result("n4")
    console = Console(record=True, width=200)
    sfr.print_tables(r, console)
    text = console.export_text()
    kv = r["choices"]
    assert f"prompt-part KV blocks {kv['block_ratio']:.3f}x" in text
    assert f"tail {kv['tail_tokens']:.1f} tokens" in text and "ceil(L/B)" in text
    [png] = [p for p in sfr.write_outputs(r, str(tmp_path)) if p.endswith(".png")]
    assert png.endswith("bench_serve_n4.png") and os.path.getsize(png) > 5000


# ---- the command line -----------------------------------------------------------------------
@pytest.mark.parametrize("flags, message", [
    (["--workload", "structured", "--feature-pairs", "0"], "--feature-pairs"),
    (["--feature-pairs", "2"], "--feature-pairs applies to --workload"),
    (["--workload", "tools", "--trace", __file__], "--trace does not apply"),
    (["--workload", "n4", "--internal-tls", "both"], "--internal-tls both"),
    (["--workload", "structured", "--max-tokens", str(sf.MAX_TOKENS + 1)], "--max-tokens"),
    (["--workload", "structured", "--concurrency", "0"], "--concurrency"),
    (["--workload", "structured", "--requests", "0"], "--requests"),
])
def test_bad_feature_flag_names_it(flags, message, capsys):
    assert bench_serve.main(flags) == 2
    assert message in capsys.readouterr().err


def test_feature_workload_defaults_and_unknown_workload(capsys):
    p = bench_serve.add_arguments(__import__("argparse").ArgumentParser())
    args = p.parse_args(["--workload", "n4"])
    s = bench_serve.settings_from(args)
    fs = sf.settings_from(args, s)
    assert (s.requests, s.concurrency, fs.pairs, fs.workload) == (
        sf.REQUESTS, sf.CONCURRENCY, sf.PAIRS, "n4")
    s = bench_serve.settings_from(p.parse_args([]))  # sharegpt keeps its own defaults
    assert (s.requests, s.concurrency) == (32, (1, 8, 32))
    with pytest.raises(SystemExit) as e:
        bench_serve.main(["--workload", "beam"])
    assert e.value.code == 2 and "--workload" in capsys.readouterr().err


# ---- a real run -----------------------------------------------------------------------------
@pytest.mark.scenario  # a whole bench run: with the long scenarios (.ci/scenarios)
@pytest.mark.timeout(90)
def test_structured_real_run(tiny_llama_dir, tmp_path):
    out = subprocess.run(
        [*BENCH, "--workload", "structured", "--model", tiny_llama_dir, "--requests", "3",
         "--concurrency", "2", "--max-tokens", "8", "--feature-pairs", "1", "--json",
         "--out", str(tmp_path), "--no-progress"],
        capture_output=True, text=True, timeout=80, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    assert r["workload"]["name"] == "structured" and r["workload"]["order"] == ["without", "with"]
    assert list(r["workload"]["fields"]) == ["response_format"]
    assert [p["variant"] for p in r["passes"]] == ["without", "with"]
    for p in r["passes"]:
        [lv] = p["levels"]
        assert lv["concurrency"] == 2
        assert (lv["requests"], lv["ok"], lv["failed"]) == (3, 3, 0), lv["errors"]
        assert lv["output_tokens"] == 3 * 8 and lv["ttft_p50_s"] > 0
        # Fresh cache salts: the prefill worker computed every prompt token of the level.
        assert len(lv["prompt_tokens_each"]) == 3
        assert lv["counters"]["prefill"]["prompt_tokens_computed"] == sum(
            lv["prompt_tokens_each"])
    # A response format leaves the prompt as it is.
    assert r["passes"][0]["levels"][0]["prompt_tokens_each"] == \
        r["passes"][1]["levels"][0]["prompt_tokens_each"]
    [row] = r["by_level"]
    wo, w = (r["passes"][i]["levels"][0] for i in (0, 1))
    assert row["tokens_ratio"]["each"] == [pytest.approx(w["tokens_per_s"] / wo["tokens_per_s"])]
    assert row["ttft_p50_diff_s"]["mean"] == pytest.approx(w["ttft_p50_s"] - wo["ttft_p50_s"])
    assert [a["unit"] for a in r["aims"]] == ["x", "s"]
    assert r["cluster"]["config"]["block_size_tokens"] == 16
    with open(tmp_path / "summary.json") as f:
        assert json.load(f) == r
    assert os.path.getsize(tmp_path / "bench_serve_structured.png") > 5000
