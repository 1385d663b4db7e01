"""ShmSegment: exact-size creation, same-host attach, bounds-checked views, owner unlink."""

from __future__ import annotations

import os

import pytest

from pdserve.kvstore.node.segment import (
    SegmentBoundsError,
    SegmentClosedError,
    SegmentError,
    ShmSegment,
)


def test_create_makes_a_file_of_exact_size_and_close_unlinks_it(shm_dir):
    path = os.path.join(shm_dir, "seg")
    seg = ShmSegment.create(path, 12345)
    assert os.path.getsize(path) == 12345 and seg.owner and seg.size_bytes == 12345
    seg.close()
    assert not os.path.exists(path) and seg.closed
    seg.close()  # idempotent


def test_create_refuses_an_existing_file_and_bad_sizes(shm_dir):
    path = os.path.join(shm_dir, "seg")
    with ShmSegment.create(path, 4096):
        with pytest.raises(SegmentError, match="cannot create"):
            ShmSegment.create(path, 4096)
    for bad in (0, -1, 1.5):
        with pytest.raises(SegmentError, match="size_bytes"):
            ShmSegment.create(os.path.join(shm_dir, "x"), bad)
    assert os.listdir(shm_dir) == []


def test_attach_shares_bytes_one_memcpy_each_way_and_does_not_unlink(shm_dir):
    path = os.path.join(shm_dir, "seg")
    with ShmSegment.create(path, 1 << 16) as owner:
        client = ShmSegment.attach(path)
        assert not client.owner and client.size_bytes == 1 << 16
        client.view(100, 5)[:] = b"hello"
        assert bytes(owner.view(100, 5)) == b"hello"
        owner.view(0, 3)[:] = b"abc"
        assert bytes(client.view(0, 3)) == b"abc"
        client.close()
        assert os.path.exists(path)
    assert not os.path.exists(path)


def test_attach_missing_or_empty_file_is_a_typed_error(shm_dir):
    with pytest.raises(SegmentError, match="cannot open"):
        ShmSegment.attach(os.path.join(shm_dir, "missing"))
    empty = os.path.join(shm_dir, "empty")
    open(empty, "wb").close()
    with pytest.raises(SegmentError, match="non-empty"):
        ShmSegment.attach(empty)


@pytest.mark.parametrize("offset,size", [(-1, 1), (0, 4097), (4096, 1), (4000, 200), (0, -1)])
def test_view_out_of_bounds_is_refused(shm_dir, offset, size):
    with ShmSegment.create(os.path.join(shm_dir, "seg"), 4096) as seg:
        with pytest.raises(SegmentBoundsError):
            seg.view(offset, size)


def test_view_edges_and_closed_segment(shm_dir):
    seg = ShmSegment.create(os.path.join(shm_dir, "seg"), 4096)
    assert len(seg.view(0, 4096)) == 4096 and len(seg.view(4096, 0)) == 0
    alive = seg.view(10, 4)
    alive[:] = b"live"
    seg.close()  # a view still alive keeps the memory mapped, the file is gone
    assert bytes(alive) == b"live"
    with pytest.raises(SegmentClosedError):
        seg.view(0, 1)
