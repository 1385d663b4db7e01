"""SsdTier: whole-object writes, reads into caller buffers, byte budget, ids, restart adoption."""

from __future__ import annotations

import os

import numpy as np
import pytest

from pdserve.kvstore.node.ssd import (
    InvalidObjectId,
    SsdError,
    SsdFullError,
    SsdObjectNotFound,
    SsdTier,
)


def test_write_read_into_and_partial_ranges(tmp_path):
    tier = SsdTier(str(tmp_path), 1 << 20)
    data = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8)
    tier.write("obj-1", memoryview(data))
    assert "obj-1" in tier and tier.size_of("obj-1") == 100_000 and tier.used_bytes == 100_000
    out = bytearray(100_000)
    assert tier.read_into("obj-1", out) == 100_000
    assert out == data.tobytes()
    part = bytearray(10)
    tier.read_into("obj-1", part, offset=99_990)
    assert part == data[99_990:].tobytes()
    with pytest.raises(SsdError, match="outside"):
        tier.read_into("obj-1", bytearray(11), offset=99_990)


def test_budget_is_enforced_and_replacing_or_removing_frees_bytes(tmp_path):
    tier = SsdTier(str(tmp_path), 1000)
    tier.write("a", b"x" * 600)
    with pytest.raises(SsdFullError):
        tier.write("b", b"y" * 401)
    assert tier.used_bytes == 600 and "b" not in tier
    tier.write("b", b"y" * 400)
    assert tier.used_bytes == 1000
    tier.remove("a")
    # A replacement needs room for both versions while it is written (both files exist);
    # the old 400 bytes are freed when the new version is committed.
    with pytest.raises(SsdFullError):
        tier.write("b", b"z" * 601)
    tier.write("b", b"z" * 600)
    assert tier.used_bytes == 600
    buf = bytearray(600)
    tier.read_into("b", buf)
    assert buf == b"z" * 600
    assert sorted(os.listdir(tmp_path)) == ["b"]  # no temporary files left


def test_missing_objects_and_bad_ids_are_typed_errors(tmp_path):
    tier = SsdTier(str(tmp_path), 1000)
    with pytest.raises(SsdObjectNotFound):
        tier.read_into("nope", bytearray(1))
    with pytest.raises(SsdObjectNotFound):
        tier.remove("nope")
    for bad in ("../escape", "a/b", ".hidden", "", "x" * 201):
        with pytest.raises(InvalidObjectId):
            tier.write(bad, b"1")
    assert tier.used_bytes == 0


def test_aborted_writer_releases_its_reservation(tmp_path):
    tier = SsdTier(str(tmp_path), 1000)
    with pytest.raises(RuntimeError):
        with tier.begin_write("w", 800) as writer:
            writer.write_at(0, b"a" * 100)
            raise RuntimeError("cut off")
    assert tier.used_bytes == 0 and "w" not in tier and os.listdir(tmp_path) == []
    with tier.begin_write("w", 4) as writer:
        writer.write_at(2, b"cd")
        writer.write_at(0, b"ab")
        with pytest.raises(SsdError, match="outside"):
            writer.write_at(3, b"xy")
    buf = bytearray(4)
    tier.read_into("w", buf)
    assert buf == b"abcd"


def test_a_restarted_tier_adopts_objects_and_drops_partial_writes(tmp_path):
    tier = SsdTier(str(tmp_path), 1000, fsync=True)
    tier.write("keep", b"k" * 300)
    partial = tier.begin_write("partial", 100)  # never committed: the process "died"
    partial.write_at(0, b"p" * 100)
    again = SsdTier(str(tmp_path), 1000)
    partial.abort()
    assert again.used_bytes == 300 and "keep" in again and "partial" not in again
    assert sorted(os.listdir(tmp_path)) == ["keep"]
    with pytest.raises(SsdFullError):
        SsdTier(str(tmp_path), 200)
    (tmp_path / "not ours.txt").write_text("left alone")
    fresh = SsdTier(str(tmp_path), 200, adopt=False)  # a node that starts empty
    assert fresh.used_bytes == 0 and sorted(os.listdir(tmp_path)) == ["not ours.txt"]
