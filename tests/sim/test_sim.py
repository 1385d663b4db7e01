"""The simulator end to end: deterministic reports, a real trace through a 2P2D cluster, the
bulk decode runs equal to single steps, and the laws a capacity planner relies on (more decode
workers never slow decoding; more load never speeds up the first token)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.sim import worker as sim_worker
from pdserve.sim.config import SimConfig, SimConfigError
from pdserve.core.step_profile import load_profile
from pdserve.sim.run import simulate
from pdserve.sim.trace import SimRequest, load_trace

DATA = Path(__file__).parent / "data"
MOONCAKE = str(DATA / "mooncake_head60.jsonl")
H100 = load_profile("h100-llama3-8b")


def run(cfg: SimConfig, requests, profile=H100):
    return simulate(cfg, requests, profile)


def test_same_seed_gives_a_byte_identical_report():
    reqs = load_trace(MOONCAKE)
    cfg = SimConfig(prefill_workers=2, decode_workers=2, prefill_policy="power_of_two",
                    decode_policy="power_of_two", controller=True, block_size=512, seed=7)
    a, b = run(cfg, reqs), run(cfg, reqs)
    assert a.to_json() == b.to_json()
    assert "wall" not in a.to_json()


def test_the_report_is_the_same_across_processes_and_hash_seeds():
    code = ("import sys\n"
            "from pdserve.sim.config import SimConfig\n"
            "from pdserve.core.step_profile import load_profile\n"
            "from pdserve.sim.run import simulate\n"
            "from pdserve.sim.trace import SimRequest, load_trace\n"
            f"r = simulate(SimConfig(prefill_workers=2, decode_workers=2, controller=True, "
            f"block_size=512), load_trace({MOONCAKE!r}), load_profile('h100-llama3-8b'))\n"
            "sys.stdout.write(r.to_json())\n")
    outs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONHASHSEED": seed})
            for seed in ("1", "2")]
    assert all(o.returncode == 0 for o in outs), outs[0].stderr
    assert outs[0].stdout == outs[1].stdout and len(outs[0].stdout) > 1000


def test_a_mooncake_trace_runs_through_a_2p2d_cluster():
    reqs = load_trace(MOONCAKE)
    r = run(SimConfig(prefill_workers=2, decode_workers=2, block_size=512), reqs)
    s = r.summary()
    assert s["finished"] == len(reqs) == 60 and s["rejected"] == 0
    for i, req in enumerate(reqs):
        assert r.status[i] == "ok"
        assert 0 < r.ttft_s[i] <= r.end_s[i] - req.arrival_s
        if req.output_tokens > 1:
            itl = (r.end_s[i] - req.arrival_s - r.ttft_s[i]) / (req.output_tokens - 1)
            assert r.itl_s(i) == pytest.approx(itl)
            assert r.decode_worker[i] in ("w0002", "w0003")
        assert r.prefill_worker[i] in ("w0000", "w0001")
    assert s["kv_transfers"] == sum(1 for q in reqs if q.output_tokens > 1)
    # The trace's shared prefixes are reused: fewer prompt tokens computed than sent.
    assert s["prompt_tokens_computed"] < sum(q.prompt_tokens for q in reqs)
    assert s["events"] < s["steps"]  # decode runs: one event for many steps
    assert s["ttft_s"]["p50"] <= s["ttft_s"]["p90"] <= s["ttft_s"]["p99"]


def test_prefixes_cached_by_another_worker_come_from_the_store():
    # The second turn of a conversation goes to the other prefill worker (round robin).
    reqs = [SimRequest("turn1", 0.0, 1600, 20, (100, 101, 102, 103)),
            SimRequest("turn2", 10.0, 2400, 20, (100, 101, 102, 103, 104))]
    kw = dict(prefill_workers=2, decode_workers=1, prefill_policy="round_robin", block_size=512)
    with_store = run(SimConfig(**kw), reqs).summary()
    without = run(SimConfig(store_capacity_blocks=0, **kw), reqs).summary()
    assert with_store["store_fetch_blocks"] == 3 and without["store_fetch_blocks"] == 0
    assert with_store["prompt_tokens_computed"] < without["prompt_tokens_computed"]


def test_prefix_ids_stand_for_the_tokens_the_trace_says():
    # Two 96-token prompts that share their first 64 tokens: prefix ids per 32 tokens tell
    # them apart after that; as one id per 512 tokens, the first id covers both prompts whole.
    reqs = [SimRequest("a", 0.0, 96, 4, (1, 2, 3)), SimRequest("b", 10.0, 96, 4, (1, 2, 4))]
    computed = {seg: run(SimConfig(prefill_workers=1, decode_workers=1,
                                   prefix_block_tokens=seg), reqs).summary()
                ["prompt_tokens_computed"] for seg in (32, 512)}
    # 96 + the 32 unshared (the last full block is recomputed for its first token: +16).
    assert computed == {32: 96 + 32, 512: 96 + 16}


def test_each_request_records_its_deflection_in_the_simulated_routers_samples():
    """With the controller's budgets (prefill pressured), the simulated router weighs each
    request a budget fits, as the live one does: every offload is a decode deflection, the
    pool keeps the others, and each request's sample carries its path, choice and estimates."""
    from pdserve.sim.cluster import Cluster

    reqs = load_trace("synthetic:poisson:rate=60,n=800,in=2048,out=64", seed=0)
    cluster = Cluster(SimConfig(prefill_workers=3, decode_workers=5, controller=True, seed=0),
                      reqs, H100)
    report = cluster.run()
    counts = report.counts
    assert counts["offloaded"] == counts["deflections_decode"] > 0
    samples = cluster.connector.ring.window(cluster.q.now, float("inf"))
    assert len(samples) == len(reqs) == report.summary()["finished"]
    decided = [s for s in samples if s.deflection]
    assert sum(s.deflection == "decode" for s in decided) == counts["deflections_decode"]
    assert sum(s.deflection == "prefill" for s in decided) == counts["deflections_prefill"]
    for s in samples:
        assert s.path in ("disaggregated", "offload", "cached_local", "decode_fallback")
        assert s.offloaded == (s.path == "offload") == (s.deflection == "decode")
    for s in decided:
        assert s.decode_ttft_estimate_s > 0
        if s.deflection == "decode" and s.prefill_ttft_estimate_s is not None:
            assert s.decode_ttft_estimate_s < s.prefill_ttft_estimate_s
    assert cluster.routes == {}  # each request's route let go when it ended


def test_a_decode_worker_caching_all_but_a_short_tail_prefills_it_itself():
    """Conditional disaggregation, as the router's default: the same prompt again meets the
    decode worker that holds its blocks from the first time; it computes the 26-token tail
    itself (no prefill worker, no KV transfer before it decodes), so it ends sooner."""
    reqs = [SimRequest("first", 0.0, 1050, 20, (100, 101, 102)),
            SimRequest("again", 10.0, 1050, 20, (100, 101, 102))]
    kw = dict(prefill_workers=1, decode_workers=2, block_size=512)
    on = run(SimConfig(**kw), reqs)  # the default: 64 uncached tokens at most
    off = run(SimConfig(max_local_prefill_tokens=0, **kw), reqs)
    assert SimConfig().max_local_prefill_tokens == 64
    assert on.counts["local_prefills"] == 1 and off.counts["local_prefills"] == 0
    assert on.status == off.status == ["ok", "ok"]
    # The second request stays on the decode worker that decoded the first.
    assert on.prefill_worker[1] == on.decode_worker[1] == on.decode_worker[0] != "w0000"
    assert off.prefill_worker[1] == "w0000" != off.decode_worker[1]
    assert on.counts["kv_transfers"] == off.counts["kv_transfers"] - 1
    assert on.end_s[1] - on.ttft_s[1] < off.end_s[1] - off.ttft_s[1]
    assert on.summary()["prompt_tokens_computed"] == off.summary()["prompt_tokens_computed"]


def test_decode_runs_give_the_times_single_steps_give(monkeypatch):
    reqs = load_trace("synthetic:poisson:rate=8,n=80,in=600,out=90", seed=3)
    cfg = SimConfig(prefill_workers=1, decode_workers=2, block_size=16)
    bulk = run(cfg, reqs)
    monkeypatch.setattr(sim_worker, "MAX_RUN_STEPS", 1)
    single = run(cfg, reqs)
    assert single.summary()["steps"] == bulk.summary()["steps"]
    assert bulk.summary()["events"] < single.summary()["events"] / 3
    assert bulk.ttft_s == pytest.approx(single.ttft_s, rel=1e-6)
    assert bulk.end_s == pytest.approx(single.end_s, rel=1e-3)


def test_more_decode_workers_never_raise_mean_itl():
    reqs = load_trace("synthetic:poisson:rate=40,n=300,in=256,out=300", seed=1)
    itl = [run(SimConfig(prefill_workers=2, decode_workers=d, block_size=16, kv_blocks=4096),
               reqs).summary()["itl_s"]["mean"] for d in (1, 2, 4)]
    assert itl[0] >= itl[1] >= itl[2]
    assert itl[0] > itl[2]


def test_ttft_grows_with_load():
    base = load_trace("synthetic:poisson:rate=2,n=150,in=4000,out=20", seed=2)
    from pdserve.sim.trace import scale
    ttft = [run(SimConfig(prefill_workers=1, decode_workers=1, block_size=16),
                scale(base, rate=k)).summary()["ttft_s"]["mean"] for k in (1, 4, 16)]
    assert ttft[0] < ttft[1] < ttft[2]


def test_the_controller_flips_a_worker_to_the_pressured_role_and_pays_the_switch():
    reqs = load_trace("synthetic:poisson:rate=12,n=400,in=6000,out=8", seed=4)
    r = run(SimConfig(prefill_workers=1, decode_workers=3, controller=True, block_size=64),
            reqs)
    s = r.summary()
    assert s["flips"] >= 1
    assert s["switch_s"] == pytest.approx(s["flips"] * H100.flip_s)
    assert max(p for _, p, _, _ in r.roles) > 1  # prefill grew from its one worker
    off = run(SimConfig(prefill_workers=1, decode_workers=3, block_size=64), reqs).summary()
    assert off["flips"] == 0
    assert s["ttft_s"]["mean"] < off["ttft_s"]["mean"]


def test_bad_settings_name_the_field():
    with pytest.raises(SimConfigError, match="decode_workers"):
        SimConfig(decode_workers=0)
    with pytest.raises(SimConfigError, match="prefill_policy"):
        SimConfig(prefill_policy="nearest")
    with pytest.raises(SimConfigError, match="link"):
        SimConfig(link="bus")
    with pytest.raises(SimConfigError, match="max_local_prefill_tokens"):
        SimConfig(max_local_prefill_tokens=-1)


def test_cli_runs_a_trace_and_writes_the_report(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "sim", "run", "--trace", MOONCAKE,
         "--prefill", "1", "--decode", "1", "--block-size", "512", "--json",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)["summary"]
    assert summary["finished"] == 60
    assert "requests" in out.stderr  # progress on stderr
    for name in ("report.json", "summary.json", "roles.png"):
        assert (tmp_path / name).stat().st_size > 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert len(report["requests"]["ttft_s"]) == 60
    assert report["config"]["max_local_prefill_tokens"] == 64  # the router's default
    off = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "sim", "run", "--trace", MOONCAKE, "--limit", "5",
         "--block-size", "512", "--max-local-prefill-tokens", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["max_local_prefill_tokens"] == 0


def test_cli_refuses_a_bad_trace_naming_it():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "sim", "run", "--trace",
                          "synthetic:poisson:rate=x"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2
    assert "rate" in out.stderr


def test_the_kv_index_holds_each_prefill_workers_cache_also_after_a_flip():
    """The router's index follows only prefill workers (it is asked only about them); a worker
    that turns prefill is resynced from its cache, so the index then knows all of it."""
    from pdserve.sim.cluster import Cluster

    reqs = load_trace("synthetic:poisson:rate=12,n=400,in=6000,out=8", seed=4)
    c = Cluster(SimConfig(prefill_workers=1, decode_workers=3, controller=True, block_size=64),
                reqs, H100)
    c.run()
    index = c.router.index
    turned = [w for w in c.workers.values() if w.switches and w.role == "prefill"]
    assert turned  # a decode worker turned prefill
    for a, w in c.workers.items():
        cached = w.engine.pool.cached_hashes()
        if w.role == "prefill":
            assert cached and index.size(a) == len(cached)
            assert all(index.holds(a, h) for h in cached)
        else:
            assert index.size(a) == 0


def test_only_decode_workers_that_cannot_qualify_are_left_out_of_the_local_prefill_choice():
    """For conditional disaggregation the simulator reads the decode workers' caches only
    where the prompt's block m (the last one a qualifying worker must hold) is cached: the
    choice is the one made from every decode worker's cached prefix."""
    import random

    from pdserve.sim.cluster import Cluster
    from pdserve.sim.prompts import prompt_hashes_of

    rng = random.Random(6)
    c = Cluster(SimConfig(prefill_workers=1, decode_workers=6, block_size=16, kv_blocks=40),
                [], H100)
    decode = c.router.pool("decode")
    chosen = 0
    for step in range(300):
        ids = (1, 2, 3)  # one conversation's prefix ids: every prompt is a prefix of it
        w = c.workers[rng.choice(decode)]
        n = rng.randrange(16, 1500)
        w.engine.import_cached(prompt_hashes_of(ids, n, 0, 16))
        prompt = rng.randrange(2, 1600)
        hashes = prompt_hashes_of(ids, prompt, 0, 16)[:(prompt - 1) // 16]
        full = {a: c.workers[a].engine.cached_blocks(hashes) for a in decode}
        pruned = c.arriving._decode_cached(hashes, prompt)
        assert all(full[a] == n for a, n in pruned.items())
        got = [c.router.cached_local(x, prompt, 10, c.cfg.max_local_prefill_tokens)
               for x in (full, pruned)]
        for g in got:
            if g is not None:
                c.router.release(*g)
        assert got[0] == got[1], step
        chosen += got[0] is not None
    assert chosen > 20


def test_the_decode_holders_count_every_block_each_decode_worker_holds_also_after_flips():
    """`Arrivals._decode_cached` skips the decode caches for a block outside the holders map,
    so the map must count, for every block, the decode workers caching it, including workers
    that turned decode, and nothing else (a block no decode worker holds leaves it)."""
    from collections import Counter

    from pdserve.sim.cluster import Cluster

    reqs = load_trace("synthetic:poisson:rate=12,n=400,in=200,out=2000", seed=4)
    c = Cluster(SimConfig(prefill_workers=3, decode_workers=1, controller=True, block_size=16,
                          kv_blocks=400), reqs, H100)
    c.run()
    turned = [w for w in c.workers.values() if w.switches and w.role == "decode"]
    assert turned  # prefill workers turned decode
    decode = [w for w in c.workers.values() if w.role == "decode"]
    assert all(w.engine.pool.by_hash for w in decode)
    assert c._decode_held == Counter(h for w in decode for h in w.engine.pool.by_hash)
    assert not any(w.engine.recorder.holders is not None for w in c.workers.values()
                   if w.role == "prefill")


def test_a_flip_whose_drain_outlasts_its_timeout_fails_and_the_worker_is_readmitted():
    reqs = load_trace("synthetic:poisson:rate=12,n=400,in=6000,out=200", seed=4)
    cfg = dict(prefill_workers=1, decode_workers=3, controller=True, block_size=64)
    ok = run(SimConfig(**cfg), reqs)
    assert ok.summary()["failed_flips"] == 0 and ok.summary()["flips"] >= 1
    r = run(SimConfig(**cfg, drain_timeout_s=0.01, failed_readmit_s=5.0), reqs)
    s = r.summary()
    assert s["failed_flips"] >= 1
    assert all(st == "ok" for st in r.status)  # a failed flip loses no request
    # Out of both pools after the failure (neither serving nor moving), back at re-admission.
    out = [t for t, p, d, moving in r.roles if p + d + moving < 4]
    assert out, "no worker left both pools"
    assert r.roles[-1][1] + r.roles[-1][2] == 4
    back = min(t for t, p, d, moving in r.roles if t > out[0] and p + d + moving == 4)
    assert back - out[0] >= 5.0
