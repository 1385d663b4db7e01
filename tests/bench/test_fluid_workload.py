"""The workloads of `pdserve bench fluid` (pure, seeded): every kind deterministic, its phases
labelled by arrival, its rates and lengths what the settings say; a trace file's arrivals and
lengths scaled, clipped to the model's context, and its errors naming the option."""

from __future__ import annotations

import json
import os

import pytest

from pdserve.bench.fluid_workload import (
    WORKLOADS, Shape, WorkloadError, make_workload, mooncake_records, scale_lengths, traces_dir)

needs_traces = pytest.mark.skipif(
    not os.path.isfile(os.path.join(traces_dir(), "AzureLLMInferenceTrace_code.csv")),
    reason="the shared traces (../shared/traces or PDSERVE_TRACES) are not here")


def _make(kind: str, **kw):
    args = {"phase_s": 30.0, "prefill_rps": 2.0, "decode_rps": 1.0, "vocab": (100, 1000),
            "seed": 3, **kw}
    return make_workload(traces_dir(), Shape(max_prompt_tokens=400), kind=kind, **args)


def _mean(xs):
    return sum(xs) / len(xs)


@needs_traces
@pytest.mark.parametrize("kind", ["two-phase", "bursty", "drift"])
def test_every_synthetic_workload_is_seeded_and_labels_its_phases(kind):
    w = _make(kind)
    assert w == _make(kind)  # seeded: every configuration and run gets the same
    assert w != _make(kind, seed=4)
    assert w.kind == kind and w.duration_s == 30.0 * len(w.phases)
    arrivals = [r.arrival_s for r in w.requests]
    assert arrivals == sorted(arrivals) and 0 < arrivals[0] and arrivals[-1] < w.duration_s
    for r in w.requests:  # each request is labelled with the phase its arrival falls in
        ph = next(p for p in w.phases if p.name == r.phase)
        assert ph.start_s <= r.arrival_s < ph.end_s
    assert all(16 <= len(r.prompt) <= 400 and 2 <= r.max_tokens <= 256 for r in w.requests)
    assert all(100 <= t < 1000 for r in w.requests for t in r.prompt)


@needs_traces
def test_two_phase_is_prefill_heavy_then_decode_heavy():
    w = _make("two-phase")
    assert [p.name for p in w.phases] == ["prefill", "decode"] and w.decode_from_s == 30.0
    pre = [r for r in w.requests if r.phase == "prefill"]
    dec = [r for r in w.requests if r.phase == "decode"]
    assert _mean([len(r.prompt) for r in pre]) > 2 * _mean([len(r.prompt) for r in dec])
    assert _mean([r.max_tokens for r in dec]) > 4 * _mean([r.max_tokens for r in pre])


@needs_traces
def test_the_arrivals_read_back_as_the_simulators_trace(tmp_path):
    from pdserve.sim.trace import read_mooncake

    w = _make("two-phase")
    path = tmp_path / "arrivals.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in mooncake_records(w)))
    back = read_mooncake(path)
    assert [(round(b.arrival_s, 6), b.prompt_tokens, b.output_tokens) for b in back] == [
        (round(r.arrival_s, 6), len(r.prompt), r.max_tokens) for r in w.requests]
    # Each request its own blocks, one per 512 prompt tokens begun: no prefix is shared.
    ids = [h for b in back for h in b.block_hashes]
    assert len(ids) == len(set(ids)) == sum(-(-len(r.prompt) // 512) for r in w.requests)


@needs_traces
def test_rates_are_the_settings_rates():
    n = 12  # seeds: the counts' mean is within a few standard errors of the expected count
    two = [_make("two-phase", seed=s, phase_s=100.0) for s in range(n)]
    assert _mean([sum(r.phase == "prefill" for r in w.requests) for w in two]) == \
        pytest.approx(200, rel=0.1)
    assert _mean([sum(r.phase == "decode" for r in w.requests) for w in two]) == \
        pytest.approx(100, rel=0.1)
    bursty = [_make("bursty", seed=s, phase_s=100.0) for s in range(n)]
    for name, want in (("before", 100), ("burst", 300), ("after", 100)):
        assert _mean([sum(r.phase == name for r in w.requests) for w in bursty]) == \
            pytest.approx(want, rel=0.1)
    drift = [_make("drift", seed=s, phase_s=100.0) for s in range(n)]
    # The rate moves linearly from 2/s to 1/s over 300 s: 5/6, 1/2 and 1/6 of the way.
    for name, rate in (("early", 2 - 1 / 6), ("middle", 1.5), ("late", 1 + 1 / 6)):
        assert _mean([sum(r.phase == name for r in w.requests) for w in drift]) == \
            pytest.approx(100 * rate, rel=0.1)


@needs_traces
def test_bursty_bursts_long_prompts_and_drift_drifts_toward_decode():
    b = _make("bursty", phase_s=100.0)
    assert [p.name for p in b.phases] == ["before", "burst", "after"]
    assert b.decode_from_s == 200.0  # the burst's end: the controller should flip back
    ratio = {p.name: sum(len(r.prompt) for r in b.requests if r.phase == p.name)
             / sum(r.max_tokens for r in b.requests if r.phase == p.name) for p in b.phases}
    assert ratio["burst"] > 2 * max(ratio["before"], ratio["after"])
    ratios = []
    for s in range(6):
        d = _make("drift", seed=s, phase_s=100.0)
        assert d.decode_from_s is None
        ratios.append([sum(len(r.prompt) for r in d.requests if r.phase == p.name)
                       / sum(r.max_tokens for r in d.requests if r.phase == p.name)
                       for p in d.phases])
    early, middle, late = (_mean([r[i] for r in ratios]) for i in range(3))
    assert early > middle > late


def test_lengths_scale_then_clip_to_the_shape_and_the_context():
    shape = Shape(max_prompt_tokens=1024, min_prompt_tokens=16, max_output_tokens=256)
    assert scale_lengths(4000, 40, 0.25, 1.0, shape, None) == (1000, 40)
    assert scale_lengths(8000, 40, 0.25, 1.0, shape, None) == (1024, 40)
    assert scale_lengths(8000, 1000, 0.25, 1.0, shape, 600) == (600 - 256, 256)
    assert scale_lengths(10, 1, 1.0, 1.0, shape, None) == (16, 2)
    # A context smaller than the shape's minimum prompt plus the answer: the context wins.
    assert sum(scale_lengths(100, 100, 1.0, 1.0, shape, 20)) <= 20


def _azure(path, rows):
    with open(path, "w") as f:
        f.write("TIMESTAMP,ContextTokens,GeneratedTokens\n")
        for t, i, o in rows:
            f.write(f"2023-11-16 18:{t // 60:02d}:{t % 60:02d}.000000,{i},{o}\n")


def test_a_trace_file_is_replayed_scaled_in_time_and_length(tmp_path):
    az = str(tmp_path / "a.csv")
    _azure(az, [(0, 4000, 30), (10, 8000, 20), (20, 400, 10), (70, 4000, 10)])
    w = make_workload("", Shape(), kind="trace", trace_path=az, speedup=2.0, phase_s=10.0,
                      prefill_rps=1, decode_rps=1, vocab=(100, 1000), seed=0,
                      context_tokens=1000)
    assert [r.arrival_s for r in w.requests] == [0.0, 5.0, 10.0]  # 70 s / 2 is past 3 x 10
    assert [r.phase for r in w.requests] == ["early", "early", "middle"]
    # Azure lengths: prompt x 1/4 (the shape's prefill factors), clipped to the context.
    assert [(len(r.prompt), r.max_tokens) for r in w.requests] == [(1000 - 30, 30),
                                                                   (1000 - 20, 20), (100, 10)]
    moon = str(tmp_path / "m.jsonl")
    with open(moon, "w") as f:
        for t, i, o in ((0, 6400, 100), (30_000, 64_000, 2000)):
            f.write(json.dumps({"timestamp": t, "input_length": i, "output_length": o,
                                "hash_ids": [1]}) + "\n")
    w = make_workload("", Shape(), kind="trace", trace_path=moon, speedup=0.5, phase_s=30.0,
                      prefill_rps=1, decode_rps=1, vocab=(100, 1000), seed=0)
    # Mooncake lengths: prompt x 1/64, answer x 1/2 capped at 256; arrivals x 2.
    assert [(r.arrival_s, r.phase, len(r.prompt), r.max_tokens) for r in w.requests] == [
        (0.0, "early", 100, 50), (60.0, "late", 1000, 256)]
    assert w == make_workload("", Shape(), kind="trace", trace_path=moon, speedup=0.5,
                              phase_s=30.0, prefill_rps=1, decode_rps=1, vocab=(100, 1000),
                              seed=0)


def test_bad_settings_and_traces_name_the_option(tmp_path):
    kw = {"phase_s": 10.0, "prefill_rps": 1.0, "decode_rps": 1.0, "vocab": (100, 1000),
          "seed": 0}
    with pytest.raises(WorkloadError, match="--workload"):
        make_workload("", Shape(), kind="sine", **kw)
    with pytest.raises(WorkloadError, match="--trace"):
        make_workload("", Shape(), kind="trace", **kw)
    with pytest.raises(WorkloadError, match="--trace.*missing"):
        make_workload("", Shape(), kind="trace", trace_path=str(tmp_path / "missing.csv"), **kw)
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,1,2\n")
    with pytest.raises(WorkloadError, match="--trace .*bad.csv:2"):
        make_workload("", Shape(), kind="trace", trace_path=str(bad), **kw)
    with pytest.raises(WorkloadError, match="--speedup"):
        make_workload("", Shape(), kind="trace", trace_path=str(bad), speedup=0, **kw)
    with pytest.raises(WorkloadError, match="--decode-rps"):
        make_workload("", Shape(), kind="drift", **{**kw, "decode_rps": 0})
    assert set(WORKLOADS) == {"two-phase", "bursty", "drift", "trace"}
