"""Planning: the phase-shifting trace shifts its work half way, the candidate set covers the
splits, policies and controller settings, bad flags are named, and a small plan runs end to end
through the simulator and writes its table, JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.sim.plan import (Candidate, PlanError, add_arguments, best_of, controller_candidates,
                              phase_shift_trace, routing_candidates, settings_from_args, split,
                              static_candidates)

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str):
    import argparse
    return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_phase_trace_shifts_from_prefill_to_decode_work():
    reqs = phase_shift_trace(duration_s=600, rate=4.0, seed=1)
    assert reqs == phase_shift_trace(duration_s=600, rate=4.0, seed=1)  # seeded
    assert all(0 <= r.arrival_s < 600 for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    first = [r for r in reqs if r.arrival_s < 300]
    second = [r for r in reqs if r.arrival_s >= 300]
    ratio = [sum(r.prompt_tokens for r in h) / sum(r.output_tokens for r in h)
             for h in (first, second)]
    assert ratio[0] > 50 * ratio[1]  # prompt tokens per output token collapses half way
    assert 0.8 < len(reqs) / (600 * 4.0) < 1.2
    ids = [h for r in reqs for h in r.block_hashes]
    assert len(ids) == len(set(ids))  # no shared prefixes: the shift is the only change


def test_candidates():
    assert split(1000, 0.25) == (250, 750)
    assert split(4, 0.05) == (1, 3) and split(4, 0.99) == (3, 1)
    static = static_candidates(1000)
    assert [c.prefill_workers for c in static] == [125, 250, 375, 500, 625, 750]
    assert all(c.prefill_workers + c.decode_workers == 1000 for c in static)
    assert len(static_candidates(4)) == 3  # duplicates of tiny clusters collapse
    ctl = controller_candidates(1000)
    assert all(c.controller for c in ctl)
    assert {"fluid_token": False} in [c.policy for c in ctl]
    assert any(c.policy.get("max_flips_per_tick") == 10 for c in ctl)
    pols = {c.prefill_policy for c in routing_candidates(static[1])}
    assert "kv_aware" not in pols and {"round_robin", "least_loaded"} <= pols


def test_best_of_prefers_goodput_then_attainment_then_fewer_worker_hours():
    rows = [{"name": "a", "goodput_rps": 5, "attainment": 0.9, "worker_hours": 10},
            {"name": "b", "goodput_rps": 5, "attainment": 0.9, "worker_hours": 8},
            {"name": "c", "goodput_rps": 4, "attainment": 1.0, "worker_hours": 1}]
    assert best_of(rows)["name"] == "b"


@pytest.mark.parametrize("argv,field", [(("--workers", "1"), "--workers"),
                                        (("--itl-slo-ms", "0"), "--itl-slo-ms"),
                                        (("--transport", "rdma"), "--transport"),
                                        (("--jobs", "0"), "--jobs"),
                                        (("--block-size", "0"), "--block-size")])
def test_bad_flags_are_named(argv, field):
    with pytest.raises(PlanError, match=field):
        settings_from_args(_parse("--trace", "phase", *argv))


def test_defaults_are_stated():
    s = settings_from_args(_parse("--trace", "phase"))
    assert (s["workers"], s["ttft_slo_ms"], s["itl_slo_ms"]) == (1000, 2000.0, 100.0)
    assert s["profile"] == "h100-llama3-8b"
    assert s["block_size"] == 16
    from pdserve.sim.plan import _sim_config
    s512 = settings_from_args(_parse("--trace", "phase", "--block-size", "512"))
    assert _sim_config(Candidate("x", "static", 1, 1), s512).block_size == 512
    assert Candidate("x", "static", 1, 1).prefill_policy == "kv_aware"


def test_small_plan_end_to_end(tmp_path):
    out = tmp_path / "plan"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.sim.plan", "--trace", "phase", "--workers", "4",
         "--duration-s", "60", "--rate", "0.5", "--jobs", "1", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[plan" in proc.stderr
    doc = json.loads(proc.stdout)
    kinds = {r["kind"] for r in doc["rows"]}
    assert kinds == {"static", "routing", "controller"}
    assert doc["best"] in {r["name"] for r in doc["rows"]}
    for r in doc["rows"]:
        assert 0.0 <= r["attainment"] <= 1.0
        assert r["worker_hours"] > 0
        assert r["finished"] + r["rejected"] <= r["requests"]
    assert all(r["roles"] for r in doc["rows"] if r["controller"])
    assert (out / "plan.png").stat().st_size > 10_000
    assert json.loads((out / "plan.json").read_text())["rows"] == doc["rows"]
