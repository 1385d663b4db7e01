"""Pressure signals: counters in, ratios against the SLO out (plain numbers, no clock)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.core.rates import RateMeter
from pdserve.controller.signals import (Slo, attainment, decode_pressure, percentile,
                                        prefill_pressure)

SLO = Slo(ttft_s=2.0, itl_s=0.2, ttft_share=0.5)  # the prefill queue may take 1.0 s


# ---- prefill ------------------------------------------------------------------------------------

def test_prefill_pressure_is_queued_work_over_the_ttft_share():
    p = prefill_pressure(1500, 1000.0, SLO)
    assert p.work_s == pytest.approx(1.5)
    assert p.ratio == pytest.approx(1.5)  # 1.5 s of work against a 1.0 s share
    assert (p.queued_tokens, p.tokens_per_s, p.measured) == (1500, 1000.0, True)


def test_prefill_pressure_falls_back_when_the_rate_is_unknown():
    for unknown in (None, 0.0):
        p = prefill_pressure(500, unknown, SLO, fallback_tokens_per_s=250.0)
        assert (p.tokens_per_s, p.measured) == (250.0, False)
        assert p.work_s == pytest.approx(2.0)
        assert p.ratio == pytest.approx(2.0)
    assert prefill_pressure(500, None, SLO).tokens_per_s == 1000.0  # the default fallback


def test_prefill_pressure_of_an_empty_queue_is_zero_even_after_float_drift():
    p = prefill_pressure(-1e-9, 1000.0, SLO)
    assert (p.work_s, p.ratio, p.queued_tokens) == (0.0, 0.0, 0.0)


# ---- decode -------------------------------------------------------------------------------------

def test_decode_kv_part_is_occupancy_over_the_high_water():
    d = decode_pressure(81, 100, None, 0, 4, SLO, kv_high_water=0.9)
    assert d.kv_occupancy == pytest.approx(0.81)
    assert d.kv_ratio == pytest.approx(0.9)
    assert d.ratio == pytest.approx(0.9)
    assert decode_pressure(0, 0, None, 0, 0, SLO).kv_ratio == 0.0  # nothing reported yet


def test_decode_itl_part_is_p90_over_the_slo():
    assert decode_pressure(0, 100, 0.3, 0, 4, SLO).itl_ratio == pytest.approx(1.5)
    assert decode_pressure(0, 100, None, 0, 4, SLO).itl_ratio == 0.0  # no samples


def test_decode_waiting_part_is_waiting_per_running():
    assert decode_pressure(0, 100, None, 12, 8, SLO).waiting_ratio == pytest.approx(1.5)
    assert decode_pressure(0, 100, None, 0, 4, SLO).waiting_ratio == 0.0
    # A small batch is measured against the floor: one request that arrived between two
    # steps is not pressure; eight waiting behind nothing running are.
    assert decode_pressure(0, 100, None, 1, 0, SLO).waiting_ratio == pytest.approx(0.25)
    assert decode_pressure(0, 100, None, 8, 0, SLO).waiting_ratio == pytest.approx(2.0)
    assert decode_pressure(0, 100, None, 2, 1, SLO, waiting_floor=1).waiting_ratio == 2.0


def test_prefill_ttft_part_is_recent_p90_over_the_slo():
    # An empty queue but slow first tokens is pressure.
    p = prefill_pressure(0, 1000.0, SLO, ttft_p90_s=3.0)
    assert (p.queue_ratio, p.ttft_ratio, p.ratio) == pytest.approx((0.0, 1.5, 1.5))
    p = prefill_pressure(2000, 1000.0, SLO, ttft_p90_s=0.4)
    assert (p.queue_ratio, p.ttft_ratio, p.ratio) == pytest.approx((2.0, 0.2, 2.0))


def test_decode_ratio_is_the_worst_part():
    d = decode_pressure(45, 100, 0.24, 1, 4, SLO)  # one waiting against the floor of 4
    assert (d.kv_ratio, d.itl_ratio, d.waiting_ratio) == pytest.approx((0.5, 1.2, 0.25))
    assert d.ratio == pytest.approx(1.2)


# ---- percentile, attainment ---------------------------------------------------------------------

def test_percentile_interpolates_like_numpy():
    assert percentile([], 90) is None
    assert percentile([4.0], 90) == 4.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    rng = random.Random(3)
    for _ in range(50):
        values = [rng.uniform(0, 10) for _ in range(rng.randint(1, 30))]
        q = rng.choice([0, 50, 90, 99, 100, rng.uniform(0, 100)])
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    with pytest.raises(ValueError, match="q"):
        percentile([1.0], 101)


def test_attainment_counts_requests_meeting_both_slos():
    assert attainment([], SLO) is None
    samples = [(1.0, 0.1), (2.0, 0.2), (2.1, 0.1), (1.0, 0.25)]  # the bounds are inclusive
    assert attainment(samples, SLO) == pytest.approx(0.5)


def test_slo_is_validated_at_the_boundary():
    with pytest.raises(ValueError, match="itl_s"):
        Slo(itl_s=0)
    with pytest.raises(ValueError, match="ttft_share"):
        Slo(ttft_share=1.5)


# ---- RateMeter ----------------------------------------------------------------------------------

def test_rate_meter_measures_deltas_and_smooths_them():
    m = RateMeter(alpha=0.5, min_busy_s=0.05)
    assert m.observe("w0", 1000, 10.0) is None  # a baseline, no delta yet
    assert m.observe("w0", 1100, 10.1) == pytest.approx(1000.0)
    assert m.observe("w0", 1400, 10.2) == pytest.approx(0.5 * 3000 + 0.5 * 1000)
    assert m.rate("w0") == pytest.approx(2000.0)
    assert m.rate("w1") is None


def test_rate_meter_waits_for_min_busy_time_and_keeps_the_baseline():
    m = RateMeter(alpha=1.0, min_busy_s=0.05)
    m.observe("w0", 0, 0.0)
    assert m.observe("w0", 30, 0.03) is None  # 30 ms busy: timer noise, not a rate
    assert m.observe("w0", 60, 0.06) == pytest.approx(1000.0)  # the two deltas added up


def test_rate_meter_restarts_a_key_whose_counters_went_down():
    m = RateMeter(alpha=1.0)
    m.observe("w0", 0, 0.0)
    assert m.observe("w0", 500, 1.0) == pytest.approx(500.0)
    assert m.observe("w0", 10, 0.01) is None  # the worker restarted
    assert m.rate("w0") is None
    assert m.observe("w0", 210, 0.11) == pytest.approx(2000.0)
    m.forget("w0")
    assert m.rate("w0") is None and m.observe("w0", 1000, 5.0) is None
