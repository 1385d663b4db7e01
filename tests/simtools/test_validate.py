"""Validation: the simulator sees the same prompt sharing as the real cluster, errors are computed
against the measured side, bad flags are named, and a tiny replay runs on a real 1P1D cluster
and in the simulator and writes its table, JSON and plot (the error is reported, not asserted)."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.core.step_profile import StepProfile, load_profile
from pdserve.simtools.validate import (ValidateError, add_arguments, background_of,
                                       parse_configs, settings_from_args, shared_fraction,
                                       sim_blocks)
from pdserve.simtools.validate_compare import compare, ranking, rankings

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT / "tests" / "data" / "mooncake_conversation_trace_head300.jsonl"


def test_sim_blocks_are_equal_exactly_when_the_prefix_is():
    a = list(range(1200))
    b = a[:1024] + [7] * 100  # shares two whole 512-token blocks with a
    c = [9] + a[1:1200]  # differs in the first token: shares nothing
    ids = sim_blocks([a, b, c], 512)
    assert ids[0][:2] == ids[1][:2] and ids[0][2] != ids[1][2]
    assert not set(ids[2]) & set(ids[0])
    assert [len(x) for x in ids] == [3, 3, 3]
    assert sim_blocks([a, b], 32)[1][:32] == sim_blocks([a], 32)[0][:32]


def test_shared_fraction():
    a = list(range(64))
    assert shared_fraction([a, a], 16) == pytest.approx(0.5)
    assert shared_fraction([a, [1] + a[1:]], 16) == 0.0


def test_compare_is_relative_to_the_real_side():
    real = {"ttft_s": [1.0, 1.0], "itl_s": [0.1, 0.1], "e2e_s": [2.0, 2.0]}
    sim = {"ttft_s": [1.2, 1.2], "itl_s": [0.09, 0.09], "e2e_s": [2.0, 2.0]}
    c = compare(real, sim)
    assert c["ttft_s"]["mean"]["error"] == pytest.approx(0.2)
    assert c["itl_s"]["p90"]["error"] == pytest.approx(-0.1)
    assert c["e2e_s"]["p99"]["error"] == 0.0
    assert compare(real, {**sim, "itl_s": []})["itl_s"]["mean"]["error"] is None


@pytest.mark.parametrize("text", ["1p", "pd", "0p1d", "1p1d,x"])
def test_bad_configs_are_named(text):
    with pytest.raises(ValidateError, match="--configs"):
        parse_configs(text)


@pytest.mark.parametrize("flag, value", [("--host-background", "x"),
                                         ("--host-background", "-1"),
                                         ("--workers-per-host", "-1"),
                                         ("--stagger-ms", "-5")])
def test_bad_host_flags_are_named(flag, value):
    args = add_arguments(argparse.ArgumentParser()).parse_args([flag, value])
    with pytest.raises(ValidateError, match=flag):
        settings_from_args(args)


def test_measured_host_background_is_the_other_runnable_threads():
    real = {"loadavg_1m_before_cluster": 1.25, "other_runnable_threads": 0.75}
    assert background_of({"host_background": "measured"}, real) == 0.75
    assert background_of({"host_background": "0.5"}, real) == 0.5
    # Older records: the load average before the cluster started, else nothing.
    assert background_of({"host_background": "measured"},
                         {"loadavg_1m_before_cluster": 1.25}) == 1.25
    assert background_of({"host_background": "measured"}, {}) == 0.0


@pytest.mark.scenario  # a whole replay on a real cluster: with the long scenarios (.ci/scenarios)
def test_tiny_replay_on_a_real_cluster_and_the_simulator(tmp_path):
    out = tmp_path / "v"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.simtools.validate", "--trace", str(TRACE), "--requests", "4",
         "--scale", "64", "--max-tokens", "4", "--rate", "1", "--configs", "1p1d",
         "--steps", "quick", "--out", str(out), "--json"], capture_output=True, text=True,
        timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    run = doc["runs"][0]
    assert run["config"] == "1P1D" and run["real"]["ok"] == 4 and run["sim"]["ok"] == 4
    for m in ("ttft_s", "itl_s", "e2e_s"):
        for k in ("mean", "p50", "p90", "p99"):
            assert run["compare"][m][k]["real"] > 0 and run["compare"][m][k]["sim"] > 0
    assert doc["scale"]["token_scale"] == 64
    # The other work on the host, overall and while a worker computed (it did: 4 prefills).
    real = run["real"]
    assert real["other_runnable_threads"] >= 0 and 0 < real["busy_fraction"] <= 1
    assert real["other_runnable_threads_busy"] >= 0
    assert (out / "validate.png").stat().st_size > 10_000
    # The step constants were re-measured here before the real run, the rest of the profile
    # kept; the shipped constants' errors are reported beside.
    prof = StepProfile.from_dict(doc["profile"])
    shipped = load_profile("cpu-smollm2-135m")
    assert "step constants re-measured" in doc["profile_origin"]
    assert prof.fit["steps_now"]["replaced"]["prefill_token_s"] == shipped.prefill_token_s
    assert prof.prefill_token_s > 0 and prof.prefill_token_s != shipped.prefill_token_s
    assert (prof.transports, prof.host_slowdown) == (shipped.transports, shipped.host_slowdown)
    given = run["compare_given"]["ttft_s"]["mean"]
    assert given["real"] == run["compare"]["ttft_s"]["mean"]["real"] and given["sim"] > 0
    # Replayed from the record: the same measured side and the same re-measured constants.
    again = subprocess.run(
        [sys.executable, "-m", "pdserve.simtools.validate", "--trace", str(TRACE), "--requests", "4",
         "--scale", "64", "--max-tokens", "4", "--rate", "1", "--configs", "1p1d",
         "--real-from", str(out / "validate.json"), "--out", str(tmp_path / "v2"), "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    doc2 = json.loads(again.stdout)
    assert doc2["profile"] == doc["profile"]
    assert doc2["runs"][0]["compare"] == run["compare"]
    assert doc["scale"]["stagger_ms"] == doc2["scale"]["stagger_ms"] == 20.0
    # A record from before the spacing (no stagger in its scale) is simulated with its arrivals
    # as they were sent, simultaneous, whatever --stagger-ms says.
    old = {**doc, "scale": {k: v for k, v in doc["scale"].items() if k != "stagger_ms"}}
    (tmp_path / "old.json").write_text(json.dumps(old))
    third = subprocess.run(
        [sys.executable, "-m", "pdserve.simtools.validate", "--trace", str(TRACE), "--requests", "4",
         "--scale", "64", "--max-tokens", "4", "--rate", "1", "--configs", "1p1d",
         "--stagger-ms", "50", "--real-from", str(tmp_path / "old.json"),
         "--out", str(tmp_path / "v3"), "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert third.returncode == 0, third.stderr[-3000:]
    assert json.loads(third.stdout)["scale"]["stagger_ms"] == 0.0


@pytest.mark.scenario  # a whole replay on an emulated cluster: with the long scenarios (.ci/scenarios)
def test_an_emulated_cluster_is_replayed_against_the_simulator_on_the_same_profile(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.simtools.validate", "--trace", str(TRACE), "--requests",
         "12", "--scale", "64", "--max-tokens", "16", "--rate", "4", "--configs", "2p3d",
         "--engine", "emulated", "--profile", "h100-llama3-8b", "--kv-scale", "0.01",
         "--routing", "kv_aware,round_robin", "--slowdown", "2",
         "--out", str(tmp_path / "e"), "--json"], capture_output=True, text=True, timeout=600,
        cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert [r["label"] for r in doc["runs"]] == ["2P3D kv_aware", "2P3D round_robin"]
    run = doc["runs"][0]
    assert run["config"] == "2P3D" and run["real"]["ok"] == run["sim"]["ok"] == 12
    # Both sides use the profile's steps twice as long (--slowdown), its KV bytes scaled as
    # the emulated workers'; the simulator adds what this machine's processes take around
    # those steps, measured on an emulated 1P1D cluster (a GPU profile has no serving costs of
    # its own).
    shipped = load_profile("h100-llama3-8b")
    prof = StepProfile.from_dict(doc["profile"])
    assert prof.weights_read_s == 2 * shipped.weights_read_s
    assert prof.prefill_token_s == 2 * shipped.prefill_token_s
    # The emulated workers ran the slower steps too: a decode step's gap is at least the
    # slowed step, which the shipped one is well under.
    assert run["compare"]["itl_s"]["p50"]["real"] >= prof.decode_s(1, 0)
    # The two policies are ranked on both sides, per metric.
    assert set(doc["rankings"]["ttft_s.mean"]["real"]) == {"2P3D kv_aware", "2P3D round_robin"}
    assert prof.kv_bytes_per_token == round(shipped.kv_bytes_per_token * 0.01)
    assert shipped.serve_prefill_step_s == shipped.serve_step_s == 0
    assert prof.serve_prefill_step_s + prof.serve_prefill_token_s > 0
    assert prof.serve_step_s + prof.serve_seq_s > 0
    assert [r["tokens"] for r in prof.fit["serving_now"]["serving_prefill"]] == [32, 128, 512]
    assert doc["settings"]["engine"] == "emulated"
    for m in ("ttft_s", "itl_s", "e2e_s"):
        assert run["compare"][m]["mean"]["real"] > 0 and run["compare"][m]["mean"]["sim"] > 0


def test_bad_trace_is_one_line_not_a_traceback():
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--trace", "/no/such.jsonl"])
    with pytest.raises(ValidateError, match="--trace: no such file"):
        settings_from_args(args)


def test_simultaneous_arrivals_are_spaced_in_trace_order():
    from pdserve.bench.serve_workload import token_request
    from pdserve.simtools.validate import stagger

    times = [0.0, 0.0, 0.0, 0.05, 3.0, 3.0, 9.0]
    reqs = [token_request([1, 2], 2, t) for t in times]
    got = [r.arrival_s for r in stagger(reqs, 0.05)]
    # The group at 0 spaced 50 ms apart runs past the one at 0.05, which follows it; the later
    # times are kept, their own group spaced.
    assert got == pytest.approx([0.0, 0.05, 0.1, 0.15, 3.0, 3.05, 9.0])
    assert [r.arrival_s for r in stagger(reqs, 0.0)] == times
    assert stagger(reqs, 0.05)[0] is reqs[0]  # unchanged requests are the same objects


def test_ranking_counts_only_pairs_the_real_side_separates():
    # a < b < c measured; the simulator swaps b and c and calls a and b equal.
    vals = {"a": (1.0, 2.0), "b": (2.0, 2.0), "c": (3.0, 1.9), "d": (3.05, 5.0)}
    r = ranking(vals, tie=0.05)
    assert r["real"] == ["a", "b", "c", "d"] and r["sim"][0] == "c"
    # c and d are within 5% on the real side: a tie, either order right; five pairs remain.
    assert r["pairs"] == 5 and not r["same"]
    assert sorted(r["wrong"]) == [["a", "b"], ["a", "c"], ["b", "c"]]
    assert ranking({"x": (1.0, 1.5), "y": (2.0, 2.5)})["same"]


def test_rankings_cover_each_metric_and_need_two_runs():
    def run(label, ttft, itl, e2e):
        return {"label": label, "compare": compare(
            {"ttft_s": [ttft], "itl_s": [itl], "e2e_s": [e2e]},
            {"ttft_s": [ttft * 1.1], "itl_s": [itl * 0.9], "e2e_s": [e2e]})}
    runs = [run("1P3D", 2.0, 0.1, 5.0), run("2P2D", 1.0, 0.2, 6.0)]
    doc = rankings(runs)
    assert doc["ttft_s.mean"]["real"] == ["2P2D", "1P3D"] and doc["ttft_s.mean"]["same"]
    assert doc["itl_s.p90"]["real"] == ["1P3D", "2P2D"]
    assert rankings(runs[:1]) == {}


@pytest.mark.parametrize("argv, message", [
    (["--routing", "kv_aware,fastest"], "--routing: fastest is not one of"),
    (["--routing", "kv_aware,kv_aware"], "named twice"),
    (["--slowdown", "0.5", "--engine", "emulated"], "--slowdown must be >= 1"),
    (["--slowdown", "4"], "--slowdown needs --engine emulated"),
])
def test_bad_routing_and_slowdown_are_named(argv, message):
    args = add_arguments(argparse.ArgumentParser()).parse_args(["--trace", str(TRACE), *argv])
    with pytest.raises(ValidateError, match=message):
        settings_from_args(args)


def test_a_slowed_profile_scales_every_step_term_and_nothing_else():
    shipped = load_profile("h100-llama3-8b")
    slow = shipped.slowed(10)
    assert slow.decode_s(8, 4096) == pytest.approx(10 * shipped.decode_s(8, 4096))
    assert slow.prefill_s(512, 256) == pytest.approx(10 * shipped.prefill_s(512, 256))
    assert slow.flip_s == 10 * shipped.flip_s
    assert (slow.kv_bytes_per_token, slow.transports, slow.kv_capacity_tokens) == (
        shipped.kv_bytes_per_token, shipped.transports, shipped.kv_capacity_tokens)
    assert "x10" in slow.origin and shipped.slowed(1) is shipped
    with pytest.raises(ValueError, match="slowdown must be a number > 0"):
        shipped.slowed(0)
