"""Step-time profiles: the JSON round trip, errors naming the field, the shipped profiles load by
name and behave like the hardware they describe (a decode step is bound by reading the weights,
a long prefill by FLOPs; more work never takes less time)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from pdserve.core.step_profile import SHIPPED, ProfileError, StepProfile, TransportLink, load_profile
from pdserve.sim.roofline import SHIPPED_ROOFLINES, roofline_profile

ROOT = Path(__file__).resolve().parents[2]


def make_profile(**overrides) -> StepProfile:
    base = dict(origin="test", model="m", overhead_s=0.01, prefill_token_s=1e-4,
                prefill_attn_s=1e-8, decode_seq_s=2e-4, decode_ctx_s=1e-7,
                transports={"tcp": TransportLink(1e-3, 1e9)}, kv_bytes_per_token=100,
                flip_s=0.5, startup_s=3.0, kv_capacity_tokens=1000)
    return StepProfile(**{**base, **overrides})


def test_json_round_trip_is_exact(tmp_path):
    p = make_profile(fit={"points": 3})
    path = tmp_path / "p.json"
    p.save(path)
    q = load_profile(path)
    assert q == p
    assert q.to_json() == p.to_json()


def test_step_formula():
    p = make_profile()
    # 10 tokens on 5 cached: 10 tokens, 10*5 + 10*11/2 = 105 pairs
    assert p.prefill_s(10, 5) == pytest.approx(0.01 + 10e-4 + 105e-8)
    assert p.decode_s(4, 400) == pytest.approx(0.01 + 8e-4 + 400e-7)
    assert p.mixed_s(10, 4, 400) == pytest.approx(0.01 + 10e-4 + 55e-8 + 8e-4 + 400e-7)
    assert p.prefill_s(0, 100) == 0.0 and p.decode_s(0, 0) == 0.0
    assert p.transfer_s(10**9, "tcp") == pytest.approx(1.001)


@pytest.mark.parametrize("field,value", [("decode_seq_s", -1.0), ("flip_s", float("nan")),
                                         ("kv_capacity_tokens", "many"), ("origin", "")])
def test_bad_field_is_named(field, value):
    with pytest.raises(ProfileError, match=field):
        make_profile(**{field: value})


def test_bad_json_names_the_problem():
    d = make_profile().to_dict()
    with pytest.raises(ProfileError, match="colour"):
        StepProfile.from_dict({**d, "colour": 1})
    del d["origin"]
    with pytest.raises(ProfileError, match="origin"):
        StepProfile.from_dict(d)
    with pytest.raises(ProfileError, match="transport 'rdma'"):
        make_profile().transfer_s(1, "rdma")
    with pytest.raises(ProfileError, match="batch"):
        make_profile().decode_s(-1, 0)
    for call, name in ((lambda p: p.decode_s(1, -5), "context_tokens"),
                       (lambda p: p.prefill_s(4, -1), "cached_tokens"),
                       (lambda p: p.mixed_s(4, 1, 10, -2), "prefill_cached_tokens"),
                       (lambda p: p.transfer_s(-1, "rdma"), "nbytes")):
        with pytest.raises(ProfileError, match=f"{name} must be >= 0"):
            call(make_profile())
    with pytest.raises(ProfileError, match="neither a file nor a shipped profile"):
        load_profile("no-such-profile")


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profiles_load_and_are_monotone(name):
    p = load_profile(name)
    assert p.origin.split(":")[0] in ("roofline", "measured")
    assert p.kv_capacity_tokens > 0 and p.kv_bytes_per_token > 0
    for a, b in [(16, 64), (64, 512), (512, 2048)]:
        assert p.prefill_s(a, 0) < p.prefill_s(b, 0)
        assert p.prefill_s(a, 0) <= p.prefill_s(a, 4096)
    for b in (1, 4, 16):
        assert p.decode_s(b, 1000 * b) <= p.decode_s(2 * b, 2000 * b)
    assert p.mixed_s(256, 8, 8000) >= max(p.prefill_s(256, 0), p.decode_s(8, 8000)) - 1e-12
    for t in p.transports:
        assert p.transfer_s(1 << 20, t) < p.transfer_s(1 << 24, t)


def test_roofline_bounds():
    p = roofline_profile("h100", "llama3-8b")
    weights_only = p.overhead_s + p.weights_read_s
    # One decode on a short context is bound by reading 15 GB of weights: ~5.6 ms at 80% of HBM.
    assert p.decode_s(1, 100) == pytest.approx(weights_only, rel=0.01)
    assert 0.004 < p.weights_read_s < 0.007
    # A long prefill is bound by FLOPs: twice the tokens, about twice the time.
    assert p.prefill_s(8192, 0) / p.prefill_s(4096, 0) > 1.9
    # A faster HBM speeds decode and leaves a compute-bound prefill alone.
    h200 = roofline_profile("h200", "llama3-8b")
    assert h200.decode_s(8, 8000) < p.decode_s(8, 8000)
    assert h200.prefill_s(4096, 0) == pytest.approx(p.prefill_s(4096, 0))
    # Llama-2-7B (no GQA) holds 4x the KV bytes per token of Llama-3-8B.
    assert roofline_profile("h100", "llama2-7b").kv_bytes_per_token == 4 * p.kv_bytes_per_token
    with pytest.raises(ProfileError, match="gpu"):
        roofline_profile("tpu", "llama3-8b")


def test_shipped_rooflines_are_current():
    """The JSON files are what `python -m pdserve.sim.roofline` writes from the constants."""
    for name, (gpu, model) in SHIPPED_ROOFLINES.items():
        assert load_profile(name) == roofline_profile(gpu, model), name


def test_profiles_are_package_data():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = cfg["tool"]["setuptools"]["package-data"]["pdserve.core"]
    files = {p.name for g in globs for p in (ROOT / "pdserve" / "core").glob(g)}
    assert {f"{n}.json" for n in SHIPPED} <= files


def test_imports_without_torch():
    code = ("import sys, pdserve.core.step_profile, pdserve.sim.roofline, "
            "pdserve.simtools.calibrate, "
            "pdserve.sim.plan, pdserve.sim.plan_report, pdserve.simtools.validate, "
            "pdserve.simtools.validate_report, pdserve.simtools.vidur_compare; "
            "assert 'torch' not in sys.modules")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr
