"""The arithmetic of `pdserve bench fluid`'s report (mean and spread per configuration and
phase, the best static split in hindsight, gains "within spread", the flip-back delay), the
interleaved measuring order and the run files a stopped run continues from."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.fluid import FluidBenchSettings, rounds
from pdserve.bench.fluid_runs import RunFiles, run_key
from pdserve.bench.fluid_summary import compare, flip_back_delay, stats, summarize
from pdserve.bench.fluid_workload import Request

STATIC = ["static-1:3", "static-2:2", "static-3:1"]


def _rec(overall, pre, dec, flips=(), moved=0, mismatches=0):
    fig = lambda a: {"slo_attainment": a, "goodput_rps": a}  # noqa: E731
    return {"overall": fig(overall), "phases": {"prefill": fig(pre), "decode": fig(dec)},
            "flips": sum(f["ok"] for f in flips), "flip_log": list(flips),
            "decodes_moved": moved, "tokens": {"compared": 10, "mismatches": mismatches}}


def _flip(start, to, ok=True):
    return {"start_s": start, "end_s": start + 2, "from": "x", "to": to, "ok": ok, "moved": 0}


def test_stats_are_mean_and_min_max_of_what_was_measured():
    assert stats([0.5, 0.7, 0.6]) == pytest.approx(
        {"mean": 0.6, "min": 0.5, "max": 0.7, "spread": 0.2, "n": 3})
    assert stats([0.5, None]) == {"mean": 0.5, "min": 0.5, "max": 0.5, "spread": 0.0, "n": 1}
    assert stats([None]) == {"mean": None, "min": None, "max": None, "spread": None, "n": 0}


def test_a_gain_is_within_spread_when_no_larger_than_the_larger_range():
    a, b = stats([0.80, 0.84]), stats([0.70, 0.76])  # spreads 4 and 6 points, gain 9
    assert compare(a, b) == {"points": 9.0, "spread_points": 6.0, "within_spread": False}
    c = stats([0.70, 0.82])  # spread 12 points: the 6-point gain could be noise
    assert compare(a, c) == {"points": 6.0, "spread_points": 12.0, "within_spread": True}
    assert compare(c, a)["points"] == -6.0 and compare(c, a)["within_spread"] is True
    one = compare(stats([0.9]), stats([0.8]))  # one run each: no spread to judge by
    assert one["points"] == 10.0 and one["within_spread"] is None


def test_flip_back_delay_counts_from_the_decode_phase_to_the_first_flip_toward_decode():
    flips = [_flip(5.0, "prefill"), _flip(50.0, "decode"), _flip(71.0, "decode"),
             _flip(66.0, "decode", ok=False), _flip(90.0, "decode")]
    assert flip_back_delay(flips, 60.0) == 11.0  # 50 s is before the edge; 66 s failed
    assert flip_back_delay(flips, 95.0) is None  # no flip after it
    assert flip_back_delay(flips, None) is None  # a workload without the edge


def test_summary_names_the_best_static_split_and_the_gains_per_phase():
    runs = {
        "static-1:3": [_rec(0.30, 0.10, 0.60), _rec(0.34, 0.14, 0.62)],
        "static-2:2": [_rec(0.76, 0.64, 0.96), _rec(0.80, 0.68, 0.98)],
        "static-3:1": [_rec(0.58, 0.76, 0.30), _rec(0.60, 0.78, 0.32)],
        "fluid-both": [_rec(0.85, 0.74, 0.90, [_flip(10, "prefill"), _flip(70, "decode")], 4),
                       _rec(0.87, 0.76, 0.92, [_flip(12, "prefill"), _flip(64, "decode")], 2,
                            mismatches=1)],
    }
    sm = summarize(runs, ["prefill", "decode"], static=STATIC, default="static-2:2",
                   decode_from_s=60.0)
    assert sm["best_static"] == {"overall": "static-2:2", "prefill": "static-3:1",
                                 "decode": "static-2:2"}
    per = sm["per_config"]["fluid-both"]
    assert per["attainment"]["overall"]["mean"] == pytest.approx(0.86)
    assert per["attainment"]["prefill"]["spread"] == pytest.approx(0.02)
    assert per["flip_back_delay_s"] == pytest.approx(
        {"mean": 7.0, "min": 4.0, "max": 10.0, "spread": 6.0, "n": 2})
    assert per["decodes_moved"]["mean"] == 3 and per["flips"]["mean"] == 2
    g = sm["gains"]["fluid-both"]
    assert set(sm["gains"]) == {"fluid-both"}  # static splits have no gains
    assert g["overall"]["vs_best_static"] == {"against": "static-2:2", "points": 8.0,
                                              "spread_points": 4.0, "within_spread": False}
    assert g["overall"]["vs_default"] == g["overall"]["vs_best_static"]
    # Prefill phase: 75% against 3:1's 77%, the ranges 2 points wide: a loss within spread.
    assert g["prefill"]["vs_best_static"] == {"against": "static-3:1", "points": -2.0,
                                              "spread_points": 2.0, "within_spread": True}
    assert g["decode"]["vs_default"]["points"] == -6.0
    assert sm["token_mismatches"] == 1 and sm["tokens_compared"] == 80


def test_summary_without_statics_or_default_has_no_gains_to_give():
    runs = {"fluid-role": [_rec(0.5, 0.5, 0.5)]}
    sm = summarize(runs, ["prefill", "decode"], static=STATIC, default="static-2:2",
                   decode_from_s=None)
    assert sm["best_static"] == {"overall": None, "prefill": None, "decode": None}
    assert sm["gains"]["fluid-role"]["overall"] == {"vs_best_static": None, "vs_default": None}


def test_runs_are_interleaved_with_the_order_rotated_each_round():
    assert rounds(("a", "b", "c"), 2) == [(0, "a"), (0, "b"), (0, "c"),
                                          (1, "b"), (1, "c"), (1, "a")]
    assert rounds(("a",), 3) == [(0, "a"), (1, "a"), (2, "a")]


def test_settings_errors_name_the_field():
    for kw, field in (({"runs": 0}, "runs"), ({"configs": ("static-9:9",)}, "configs"),
                      ({"workload": "sine"}, "workload"), ({"workload": "trace"}, "trace_path"),
                      ({"trace_path": "x.csv"}, "trace_path"), ({"speedup": 0}, "speedup"),
                      ({"configs": ("fluid-role", "fluid-role")}, "configs")):
        with pytest.raises(ValueError, match=field):
            FluidBenchSettings(**kw)
    assert "fluid-both-nomigrate" in FluidBenchSettings().configs


def test_run_files_resume_only_the_same_measurement(tmp_path):
    reqs = [Request("prefill", 0.5, (1, 2, 3), 4)]
    key = run_key({"phase_s": 10, "configs": ["a"], "runs": 3}, "m", reqs)
    # Which runs are made does not change the key; how one is measured, or the arrivals, do.
    assert key == run_key({"phase_s": 10, "configs": ["b"], "runs": 5}, "m", reqs)
    assert key != run_key({"phase_s": 11, "configs": ["a"], "runs": 3}, "m", reqs)
    assert key != run_key({"phase_s": 10}, "m", [Request("prefill", 0.6, (1, 2, 3), 4)])
    # An emulated cluster's settings key its runs; a cluster of real engines has none.
    real = {"phase_s": 10, "emulated": 0, "profile": "", "slowdown": 1.0, "kv_scale": 0.5,
            "workers": 4}
    assert run_key(real, "m", reqs) == key
    emu = {**real, "emulated": 8, "workers": 8}
    assert run_key(emu, "m", reqs) != key
    assert run_key({**emu, "slowdown": 2.0}, "m", reqs) != run_key(emu, "m", reqs)
    files = RunFiles(str(tmp_path), key)
    assert files.load("static-2:2", 0) is None
    files.save("static-2:2", 0, {"flips": 0})
    assert files.load("static-2:2", 0) == {"flips": 0}
    assert files.load("static-2:2", 1) is None
    assert RunFiles(str(tmp_path), "other").load("static-2:2", 0) is None
    path = tmp_path / "static-2-2.run1.json"
    assert json.loads(path.read_text())["run"] == 1
    path.write_text('{"key": "')  # cut short mid-write: measured again
    assert files.load("static-2:2", 0) is None
    none = RunFiles(None, key)
    none.save("x", 0, {})
    assert none.load("x", 0) is None
