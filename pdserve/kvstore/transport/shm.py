"""Same-host transport: map the node's shared-memory segment and copy with one memcpy.

Owns the cache of attached segments (one mapping per shm path, made on first use, kept until
`close`). Must not create or unlink segment files: the node owns them. A node that restarts
makes new files under new names, so a cached mapping of a dead incarnation is never written
through by mistake; `forget(shm_path)` drops one explicitly (e.g. after the master declares its
node dead).
"""

from __future__ import annotations

import threading

from pdserve.kvstore.node.segment import SegmentError, ShmSegment
from pdserve.kvstore.transport.base import Extent, TransportError, TransportUnavailable, byte_view


_READ_PIECE_BYTES = 64 << 20


class ShmTransport:
    """Writes and reads DRAM extents of nodes on this host through their segment files."""

    kind = "shm"

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._segments: dict[str, ShmSegment] = {}
        self._closed = False

    def _segment(self, extent: Extent) -> ShmSegment:
        if extent.tier != "dram" or not extent.shm_path:
            raise TransportUnavailable(
                f"extent {extent.segment_id}@{extent.offset} ({extent.tier}) has no shared-memory "
                "file; use the TCP transport")
        segment = self._segments.get(extent.shm_path)
        if segment is not None:
            return segment
        with self._lock:
            if self._closed:
                raise TransportError("ShmTransport is closed")
            segment = self._segments.get(extent.shm_path)
            if segment is None:
                try:
                    segment = ShmSegment.attach(extent.shm_path)
                except SegmentError as e:
                    raise TransportUnavailable(str(e)) from None
                self._segments[extent.shm_path] = segment
        return segment

    def _view(self, extent: Extent, size: int) -> memoryview:
        try:
            return self._segment(extent).view(extent.offset, size)
        except SegmentError as e:
            raise TransportError(f"extent {extent.segment_id}@{extent.offset}: {e}") from None

    def write(self, extent: Extent, src: object) -> None:
        view = byte_view(src, extent, writable=False)
        with self._view(extent, len(view)) as dst:
            dst[:] = view

    def read_into(self, extent: Extent, dst: object) -> None:
        view = byte_view(dst, extent, writable=True)
        with self._view(extent, len(view)) as src:
            # Copied in pieces: measured here, one memmove of 256 MiB out of a tmpfs mapping
            # runs at about 4.4 GB/s and 64 MiB pieces at about 8.9 (glibc's large-copy path);
            # writes into the segment are faster in one piece, so they stay whole.
            for start in range(0, len(view), _READ_PIECE_BYTES):
                end = start + _READ_PIECE_BYTES
                view[start:end] = src[start:end]

    def forget(self, shm_path: str) -> None:
        """Unmaps one segment (its node died or restarted); a later use maps it afresh."""
        with self._lock:
            segment = self._segments.pop(shm_path, None)
        if segment is not None:
            segment.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()

    def __enter__(self) -> ShmTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
