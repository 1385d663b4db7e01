"""MasterConfig validation and the per-segment extent allocator."""

from __future__ import annotations

import pytest

from pdserve.kvstore.master import ConfigError, MasterConfig
from pdserve.kvstore.master.allocator import ExtentAllocator

PAGE = 4096


def test_defaults_are_the_documented_ones() -> None:
    c = MasterConfig()
    assert (c.high_watermark, c.low_watermark, c.lease_s, c.put_timeout_s) == (0.9, 0.85, 5.0, 30.0)
    assert (c.node_timeout_s, c.eviction_sample, c.alloc_align_bytes) == (10.0, 0, 4096)
    assert c.snapshot_every_ops == 1000


@pytest.mark.parametrize("field,value", [
    ("high_watermark", 1.5), ("high_watermark", 0), ("low_watermark", -0.1),
    ("low_watermark", 0.95), ("lease_s", 0), ("put_timeout_s", -1), ("node_timeout_s", "x"),
    ("eviction_sample", -1), ("alloc_align_bytes", 1.5), ("snapshot_every_ops", True),
    ("max_events", 0),
])
def test_bad_config_names_the_field(field: str, value) -> None:
    with pytest.raises(ConfigError, match=field):
        MasterConfig(**{field: value})


def test_sizes_round_up_to_the_alignment_and_offsets_stay_aligned() -> None:
    a = ExtentAllocator(10 * PAGE, PAGE)
    assert a.alloc(1) == 0
    assert a.alloc(PAGE + 1) == PAGE
    assert a.alloc(PAGE) == 3 * PAGE
    assert a.used_bytes == 4 * PAGE
    a.check()


def test_first_fit_takes_the_lowest_hole_that_fits() -> None:
    a = ExtentAllocator(10 * PAGE, PAGE)
    offsets = [a.alloc(PAGE) for _ in range(6)]
    a.free(offsets[1])  # a 1-page hole at 1
    a.free(offsets[3])
    a.free(offsets[4])  # a 2-page hole at 3
    assert a.alloc(2 * PAGE) == 3 * PAGE  # the first hole is too small: not best fit
    assert a.alloc(PAGE) == PAGE
    a.check()


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (0, 2, 1), (1, 0, 2)])
def test_freeing_coalesces_neighbours_in_any_order(order) -> None:
    a = ExtentAllocator(3 * PAGE, PAGE)
    offsets = [a.alloc(PAGE) for _ in range(3)]
    for i in order:
        a.free(offsets[i])
        a.check()
    assert a.free_extents() == [(0, 3 * PAGE)]
    assert a.used_bytes == 0


def test_full_segment_refuses_and_a_short_tail_is_never_handed_out() -> None:
    a = ExtentAllocator(2 * PAGE + 100, PAGE)
    assert a.alloc(2 * PAGE) == 0
    assert a.alloc(1) is None
    assert a.alloc(3 * PAGE) is None
    a.check()


def test_reserve_takes_an_exact_free_range_only() -> None:
    a = ExtentAllocator(8 * PAGE, PAGE)
    assert a.reserve(3 * PAGE, 2 * PAGE)
    assert not a.reserve(4 * PAGE, PAGE)  # overlaps
    assert not a.reserve(100, PAGE)  # unaligned
    assert not a.reserve(7 * PAGE, 2 * PAGE)  # runs past the end
    assert a.free_extents() == [(0, 3 * PAGE), (5 * PAGE, 3 * PAGE)]
    assert a.alloc(3 * PAGE) == 0
    a.free(3 * PAGE)
    a.check()
