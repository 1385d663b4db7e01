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
