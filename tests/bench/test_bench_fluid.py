"""`pdserve bench fluid` on the tiny model: both phases replayed against a static split and the
controller, the document's fields, tokens identical across configurations and to the engine,
the PNGs written, and a second run over the same folder taking the kept runs instead of
measuring them again. Two short clusters, about a minute on 2 cores; figures here mean nothing.
"""

from __future__ import annotations

import os

import pytest

from pdserve.bench import fluid, fluid_report
from pdserve.bench.fluid_workload import Shape


@pytest.mark.timeout(900)
def test_bench_fluid_runs_static_and_controller_with_the_same_tokens(tiny_llama_dir, tmp_path):
    s = fluid.FluidBenchSettings(
        model_path=tiny_llama_dir, configs=("static-2:2", "fluid-both"), runs=1, phase_s=6.0,
        prefill_rps=3.0, decode_rps=2.0, shape=Shape(max_prompt_tokens=300,
                                                     max_output_tokens=48),
        num_blocks=256, cpu_quota=False, engine_checks=3,
        controller_settings={"sustain_s": 1.0, "cooldown_s": 2.0, "tick_s": 0.5})
    out = str(tmp_path / "out")
    result = fluid.run_bench(s, out_dir=out)
    runs, w = result["runs"], result["workload"]
    assert set(runs) == {"static-2:2", "fluid-both"} and w["kind"] == "two-phase"
    n = sum(w["requests"].values())
    for (r,) in runs.values():
        assert r["overall"]["requests"] == n and r["overall"]["errors"] == 0
        assert r["phases"]["prefill"]["requests"] == w["requests"]["prefill"]
        assert 0 <= r["overall"]["slo_attainment"] <= 1
        # A worker mid-flip is in neither pool for a moment; none is ever lost.
        assert r["timeline"] and all(3 <= p + d <= 4 for _, p, d in r["timeline"])
        assert all(0 <= f["start_s"] <= f["end_s"] for f in r["flip_log"])
    both = runs["fluid-both"][0]
    assert both["tokens"] == {"against": "static-2:2 run 1", "compared": n, "mismatches": 0}
    assert runs["static-2:2"][0]["flips"] == 0 and runs["static-2:2"][0]["controller"] is None
    assert both["controller"]["migrate"] is True
    assert result["engine_checked"] == 3 and result["engine_mismatches"] == 0
    sm = result["summary"]
    assert sm["best_static"]["overall"] == "static-2:2" and sm["token_mismatches"] == 0
    assert sm["gains"]["fluid-both"]["decode"]["vs_default"]["within_spread"] is None  # 1 run
    # The same arrivals for the simulator: `pdserve sim plan` ranks the splits on them.
    with open(os.path.join(out, "arrivals.jsonl")) as f:
        assert sum(1 for _ in f) == n
    assert result["sim_plan"].startswith(f"pdserve sim plan --trace {out}/arrivals.jsonl ")
    assert "--workers 4 --workers-per-copy 4" in result["sim_plan"]
    written = fluid_report.write_outputs(result, str(tmp_path))
    assert all(os.path.getsize(p) > 0 for p in written) and len(written) == 3
    # Stopped or not, the runs kept in the folder are taken, not measured again.
    again = fluid.run_bench(s, out_dir=out)
    assert again["runs_kept_from_earlier"] == 2
    assert again["summary"]["per_config"] == sm["per_config"]


@pytest.mark.timeout(600)
def test_bench_fluid_on_an_emulated_cluster_scales_the_splits_and_checks_every_token(
        tiny_llama_dir, tmp_path):
    # 8 emulated workers: each split of 4 doubled, twice the arrivals of a 4-worker run.
    s = fluid.FluidBenchSettings(
        model_path=tiny_llama_dir, configs=("static-3:1", "fluid-both"), runs=1, phase_s=5.0,
        prefill_rps=2.0, decode_rps=1.5, shape=Shape(max_prompt_tokens=300,
                                                     max_output_tokens=40),
        num_blocks=256, emulated=8, profile="h100-llama3-8b", slowdown=10.0,
        controller_settings={"sustain_s": 1.0, "cooldown_s": 2.0, "tick_s": 0.5})
    out = str(tmp_path / "out")
    result = fluid.run_bench(s, out_dir=out)
    runs, w = result["runs"], result["workload"]
    n = sum(w["requests"].values())
    from pdserve.engine.loader import load_model_config
    mc = load_model_config(tiny_llama_dir)
    assert n == len(fluid.make_workload(
        fluid.traces_dir(), s.shape, phase_s=5.0, prefill_rps=4.0, decode_rps=3.0,
        vocab=(100, mc.vocab_size - 100), seed=0,
        context_tokens=mc.max_position_embeddings).requests)
    (static,), (both,) = runs["static-3:1"], runs["fluid-both"]
    assert (static["prefill_workers"], static["decode_workers"]) == (6, 2)
    assert (both["prefill_workers"], both["decode_workers"]) == (4, 4)
    for r in (static, both):
        assert r["overall"]["requests"] == n and r["overall"]["errors"] == 0
        assert r["timeline"] and all(7 <= p + d <= 8 for _, p, d in r["timeline"])
    # Every request's tokens are the emulated engine's for its id, in both clusters.
    assert result["engine_checked"] == n and result["engine_mismatches"] == 0
    assert both["tokens"] == {"against": "static-3:1 run 1", "compared": n, "mismatches": 0}
    assert result["settings"]["workers"] == 8 and result["settings"]["cpu_quota"] is False
    # The simulator gets the same cluster: 8 workers and the profile the workers ran.
    profile = os.path.join(out, "sim-profile.json")
    assert f"--profile {profile} --workers 8 --workers-per-copy 8" in result["sim_plan"]
    from pdserve.core.step_profile import load_profile
    assert load_profile(profile).decode_s(1, 100) == pytest.approx(
        10 * load_profile("h100-llama3-8b").decode_s(1, 100))
    assert len(fluid_report.write_outputs(result, str(tmp_path))) == 3


@pytest.mark.parametrize("kw, field", [
    ({"emulated": 6}, "emulated"), ({"emulated": -4}, "emulated"),
    ({"profile": "h100-llama3-8b"}, "profile"), ({"slowdown": 2.0}, "slowdown"),
    ({"emulated": 8, "slowdown": 0.5}, "slowdown"), ({"emulated": 8, "kv_scale": 0.0}, "kv_scale"),
])
def test_bench_fluid_refuses_an_emulated_setting_it_cannot_run_and_names_it(kw, field):
    with pytest.raises(ValueError, match=field):
        fluid.FluidBenchSettings(**kw)


@pytest.mark.timeout(300)
def test_a_cluster_whose_start_meets_a_taken_port_is_started_again_on_fresh_ports(
        tiny_llama_dir, tmp_path):
    import socket

    import time

    from pdserve.bench.fluid_cluster import Replay, _started
    from pdserve.bench.fluid_workload import Request
    from pdserve.bench.route import _free_port
    from pdserve.launcher.local import ClusterSpec

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = [taken.getsockname()[1]]  # the first spec's router port is someone else's

    def make_spec() -> ClusterSpec:
        port = ports.pop() if ports else _free_port()
        return ClusterSpec(model_path=tiny_llama_dir, router_port=port,
                           store_port=_free_port(), worker_ports=(_free_port(), _free_port()),
                           http_port=None, num_blocks=64, controller=False,
                           log_dir=str(tmp_path / f"logs-{port}"))
    try:
        with _started(make_spec) as cluster:
            assert cluster.router_address.endswith(f":{cluster.spec.router_port}")
            assert cluster.spec.router_port != taken.getsockname()[1]
            # And it serves.
            replay = Replay(cluster.router_address, [Request("p", 0.0, tuple(range(100, 120)),
                                                             4)], 120)
            replay.run(time.monotonic())
            assert replay.rows[0]["error"] is None and replay.rows[0]["output_tokens"] == 4
    finally:
        taken.close()


def test_an_emulated_cluster_of_n_workers_admits_n_quarters_of_the_routers_default():
    # A 4-worker cap on 32 workers would refuse requests the cluster has room for, and count
    # them as missed.
    import dataclasses

    from pdserve.bench.fluid_cluster import _in_flight_cap
    from pdserve.router.config import RouterConfig

    default = {f.name: f.default for f in dataclasses.fields(RouterConfig)}["max_in_flight"]
    assert _in_flight_cap(4) == default and _in_flight_cap(32) == 8 * default
