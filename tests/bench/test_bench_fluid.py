"""`pdserve bench fluid` on the tiny model: both phases replayed against a static split and the
controller, the document's fields, tokens identical across configurations and to the engine,
the PNG written. Two short clusters, about a minute on 2 cores; figures here mean nothing.
"""

from __future__ import annotations

import os

import pytest

from pdserve.bench import fluid, fluid_report
from pdserve.bench.fluid_workload import Shape, make_workload, traces_dir


def test_workload_is_two_phases_shaped_from_the_traces():
    shape = Shape(max_prompt_tokens=400)
    w = make_workload(traces_dir(), shape, phase_s=30, prefill_rps=2, decode_rps=1,
                      vocab=(100, 1000), seed=3)
    assert w == make_workload(traces_dir(), shape, phase_s=30, prefill_rps=2, decode_rps=1,
                              vocab=(100, 1000), seed=3)  # seeded: every config gets the same
    pre = [r for r in w if r.phase == "prefill"]
    dec = [r for r in w if r.phase == "decode"]
    assert pre and dec and all(r.arrival_s < 30 for r in pre)
    assert all(30 <= r.arrival_s < 60 for r in dec)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # Prefill-heavy: long prompts, short answers; decode-heavy: the other way round.
    assert mean([len(r.prompt) for r in pre]) > 2 * mean([len(r.prompt) for r in dec])
    assert mean([r.max_tokens for r in dec]) > 4 * mean([r.max_tokens for r in pre])


@pytest.mark.timeout(900)
def test_bench_fluid_runs_static_and_controller_with_the_same_tokens(tiny_llama_dir, tmp_path):
    s = fluid.FluidBenchSettings(
        model_path=tiny_llama_dir, configs=("static-2:2", "fluid-both"), phase_s=6.0,
        prefill_rps=3.0, decode_rps=2.0, shape=Shape(max_prompt_tokens=300,
                                                     max_output_tokens=48),
        num_blocks=256, cpu_quota=False, engine_checks=3,
        controller_settings={"sustain_s": 1.0, "cooldown_s": 2.0, "tick_s": 0.5})
    result = fluid.run_bench(s)
    runs = result["runs"]
    assert set(runs) == {"static-2:2", "fluid-both"}
    n = result["requests"]["prefill"] + result["requests"]["decode"]
    for r in runs.values():
        assert r["overall"]["requests"] == n and r["overall"]["errors"] == 0
        assert r["prefill"]["requests"] == result["requests"]["prefill"]
        assert 0 <= r["overall"]["slo_attainment"] <= 1
        assert r["mismatches_vs_static-2:2"] == 0
        # A worker mid-flip is in neither pool for a moment; none is ever lost.
        assert r["timeline"] and all(3 <= p + d <= 4 for _, p, d in r["timeline"])
    assert runs["static-2:2"]["flips"] == 0 and runs["static-2:2"]["controller"] is None
    assert result["engine_checked"] == 3 and result["engine_mismatches"] == 0
    assert "both_minus_static_2_2_overall_points" in result["aims"]
    written = fluid_report.write_outputs(result, str(tmp_path))
    assert all(os.path.getsize(p) > 0 for p in written)
