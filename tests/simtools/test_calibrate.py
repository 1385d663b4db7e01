"""Calibration: the fit recovers known step and transfer constants, and a quick calibration of the
real engine and store on this machine writes a profile that loads, predicts more time for more
work and records the host's cores and slowdown."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.simtools.calibrate import Point, build_profile, fit_steps, fit_transfer
from pdserve.core.step_profile import StepProfile, TransportLink, attn_pairs, load_profile

ROOT = Path(__file__).resolve().parents[2]
TRUE = StepProfile(origin="truth", model="m", overhead_s=0.004, prefill_fixed_s=0.01,
                   decode_fixed_s=0.02, prefill_token_s=2e-3, prefill_attn_s=1e-6,
                   decode_seq_s=1e-3, decode_ctx_s=3e-5)


def synthetic_points() -> list[Point]:
    pts = [Point("prefill", n, c, 0, 0, TRUE.prefill_s(n, c))
           for n in (16, 64, 256, 1024) for c in (0, 512)]
    pts += [Point("decode", 0, 0, b, ctx, TRUE.decode_s(b, ctx))
            for b in (1, 4, 16) for ctx in (100 * b, 900 * b)]
    pts += [Point("mixed", p, 0, b, 300 * b, TRUE.mixed_s(p, b, 300 * b))
            for p, b in ((64, 4), (256, 8))]
    pts += [Point("batched", k * n, 0, 0, 0, TRUE.step_s(
        prefill_tokens=k * n, attn_pairs=k * attn_pairs(n, 0), kv_read_tokens=k * n), prompts=k)
            for k, n in ((4, 64), (8, 256))]
    return pts


def test_fit_recovers_known_constants():
    coef, errors = fit_steps(synthetic_points())
    for name, value in coef.items():
        assert value == pytest.approx(getattr(TRUE, name), rel=1e-6, abs=1e-12), name
    assert all(e["max_abs_rel_error"] < 1e-9 for e in errors.values())


def test_fit_keeps_coefficients_non_negative():
    # Decode steps that get faster with a bigger batch (noise on a shared machine) must not
    # produce a negative per-sequence cost: that would predict less time for more work.
    pts = synthetic_points() + [Point("decode", 0, 0, 32, 100, 0.01)] * 5
    coef, _ = fit_steps(pts)
    assert all(v >= 0 for v in coef.values()), coef


def test_fit_transfer():
    link = fit_transfer([(s, 0.002 + s / 5e8) for s in (1 << 16, 1 << 20, 1 << 24)])
    assert link.latency_s == pytest.approx(0.002)
    assert link.bytes_per_s == pytest.approx(5e8)
    with pytest.raises(ValueError, match="two sizes"):
        fit_transfer([(100, 1.0)])


def test_build_profile_records_its_fit():
    prof = build_profile(synthetic_points(), {"tcp": [(1000, 0.002), (2000, 0.003)]},
                         {"origin": "measured: test", "model": "m", "kv_bytes_per_token": 10,
                          "kv_capacity_tokens": 100, "flip_s": 0.1})
    assert prof.transports["tcp"] == TransportLink(pytest.approx(0.001), pytest.approx(1e6))
    assert set(prof.fit["errors"]) == {"prefill", "batched", "decode", "mixed"}
    assert StepProfile.from_json(prof.to_json()) == prof
    assert prof.host_cores is None and prof.host_slowdown == ()  # a fit alone says no host
    host = build_profile(synthetic_points(), {"tcp": [(1000, 0.002), (2000, 0.003)]},
                         {"origin": "measured: test", "model": "m", "kv_bytes_per_token": 10,
                          "kv_capacity_tokens": 100, "threads": 1, "host_cores": 2,
                          "host_slowdown": [1.0, 1.4]})
    assert (host.host_cores, host.threads_per_worker, host.host_slowdown) == (2, 1, (1.0, 1.4))


@pytest.mark.scenario  # a whole calibration run: with the long scenarios (.ci/scenarios)
def test_quick_calibration_of_the_real_engine(tmp_path):
    out = tmp_path / "cpu.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.simtools.calibrate", "--out", str(out), "--quick",
         "--no-cluster"], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[calibrate" in proc.stderr  # progress lines
    assert json.loads(proc.stdout)["out"] == str(out)
    prof = load_profile(out)
    assert prof.origin.startswith("measured: ")
    assert {"shm", "tcp"} <= set(prof.transports)
    assert prof.kv_bytes_per_token > 0 and prof.kv_capacity_tokens > 0
    for a, b in ((16, 64), (64, 256), (256, 1024)):
        assert prof.prefill_s(a, 0) < prof.prefill_s(b, 0)
        assert prof.prefill_s(a, 0) <= prof.prefill_s(a, 256)
    for b in (1, 2, 4, 8):
        assert prof.decode_s(b, 100 * b) <= prof.decode_s(2 * b, 200 * b)
    assert prof.transfer_s(1 << 16, "shm") < prof.transfer_s(1 << 24, "shm")
    # The host the workers would share: its cores, one thread each, and the slowdown with one
    # and two engines computing at once (1 by definition for one).
    assert prof.host_cores == len(os.sched_getaffinity(0))
    assert prof.threads_per_worker == 1
    assert len(prof.host_slowdown) == 2 and prof.host_slowdown[0] == 1.0
    assert prof.host_slowdown[1] > 0
    # And a decode step beside 0 and 1 computing prefills (1 alone by definition).
    assert len(prof.host_slowdown_decode) == 2 and prof.host_slowdown_decode[0] == 1.0
    assert prof.host_slowdown_decode[1] > 0


def test_serving_cost_is_fitted_from_the_gaps_beyond_the_engine_step():
    from pdserve.simtools.calibrate import fit_serving

    # Gaps 3 ms per step + 0.5 ms per sequence above the engine's own decode step.
    rows = [{"batch": b, "ctx": 80 * b, "gap_s": TRUE.decode_s(b, 80 * b) + 0.003 + 0.0005 * b}
            for b in (1, 4, 8, 16)]
    step, seq = fit_serving(TRUE, rows)
    assert (step, seq) == (pytest.approx(0.003), pytest.approx(0.0005))
    assert fit_serving(TRUE, []) == (0.0, 0.0)
    # A cluster faster than the engine alone (noise) must not make serving negative.
    fast = [{**r, "gap_s": TRUE.decode_s(r["batch"], r["ctx"]) * 0.9} for r in rows]
    assert fit_serving(TRUE, fast) == (0.0, 0.0)
    prof = build_profile(synthetic_points(), {"tcp": [(1000, 0.002), (2000, 0.003)]},
                         {"origin": "measured: test", "model": "m", "kv_bytes_per_token": 10,
                          "kv_capacity_tokens": 100, "serving": rows})
    assert prof.serve_step_s == pytest.approx(0.003)
    assert prof.fit["serving"] == rows
    # A served decode step costs the engine's step plus serving; a prefill step does not.
    assert prof.decode_s(8, 640) == pytest.approx(TRUE.decode_s(8, 640) + 0.003 + 0.004)
    assert prof.prefill_s(256) == pytest.approx(TRUE.prefill_s(256))


@pytest.mark.scenario  # a real cluster timed under load: with the long scenarios (.ci/scenarios)
def test_served_decode_gaps_are_timed_on_a_real_cluster():
    from pdserve.launcher.cluster_spec import free_ports
    from pdserve.launcher.local import ClusterSpec, LocalCluster
    from pdserve.engine.model_files import default_model_path
    from pdserve.simtools.calibrate_cluster import serving_firsts, serving_gaps

    said: list[str] = []
    spec = ClusterSpec(model_path=default_model_path(), router_port=free_ports(1)[0],
                       http_port=0, controller=False, ready_timeout_s=600, share_cores=False)
    with LocalCluster(spec) as cluster:
        rows = serving_gaps(cluster, (1, 3), said.append)
        firsts = serving_firsts(cluster, (16, 256), 1, said.append)
    assert [r["batch"] for r in rows] == [1, 3]
    assert [r["ctx"] for r in rows] == [80, 240]  # 64-token prompts, half of 32 tokens out
    # A token streamed through router and HTTP takes at least the engine's step (~30 ms here).
    assert all(0.001 < r["gap_s"] < 5.0 for r in rows), rows
    assert len(said) == 4 and "served decode batch 3" in said[1]
    # A single prompt's first token takes at least its prefill: longer for the longer prompt.
    assert [r["tokens"] for r in firsts] == [16, 256]
    assert 0.005 < firsts[0]["ttft_s"] < firsts[1]["ttft_s"] < 30.0, firsts
    assert "served prefill of 256 tokens" in said[3]


def test_prefill_serving_cost_is_fitted_from_first_tokens_beyond_the_engine_step():
    from pdserve.simtools.calibrate import fit_serving_prefill, with_serving

    # First tokens 20 ms + 0.2 ms per prompt token after the engine's own prefill step.
    rows = [{"tokens": n, "ttft_s": TRUE.prefill_s(n) + 0.02 + 0.0002 * n}
            for n in (32, 128, 512)]
    assert fit_serving_prefill(TRUE, rows) == (pytest.approx(0.02), pytest.approx(0.0002))
    assert fit_serving_prefill(TRUE, []) == (0.0, 0.0)
    fast = [{**r, "ttft_s": TRUE.prefill_s(r["tokens"]) * 0.9} for r in rows]
    assert fit_serving_prefill(TRUE, fast) == (0.0, 0.0)
    prof = with_serving(TRUE, {"serving_prefill": rows})
    # A served prefill step costs the engine's step plus serving; a decode step does not, and
    # refitting on a profile that already has the cost finds the same (it is not stacked).
    assert prof.prefill_s(256) == pytest.approx(TRUE.prefill_s(256) + 0.02 + 0.0512)
    assert prof.decode_s(8, 640) == pytest.approx(TRUE.decode_s(8, 640))
    assert fit_serving_prefill(prof, rows) == (pytest.approx(0.02), pytest.approx(0.0002))
