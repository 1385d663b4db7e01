"""A DRAM segment: one shared-memory file mapped read-write, addressed by byte ranges.

Owns creating (owner side) or attaching (same-host client side) the file, bounds-checked views of
it, and unlinking it when the owner closes. Must not know what the bytes mean or who owns which
range: allocation is the master's job, and concurrent writers are kept apart by that allocation,
not by locks here.

Zero copy: a client on the same host writes a value with
`segment.view(offset, n)[:] = src_view` (one memcpy, no socket, no syscall).
"""

from __future__ import annotations

import mmap
import os
import stat


class SegmentError(Exception):
    """A segment cannot be created, attached or used; the message says which and why."""


class SegmentBoundsError(SegmentError):
    """A byte range lies (partly) outside the segment."""


class SegmentClosedError(SegmentError):
    """The segment was closed; its views are gone."""


class ShmSegment:
    """A shared-memory file mapped into this process. Build with `create` or `attach`."""

    def __init__(self, path: str, size_bytes: int, mapping: mmap.mmap, owner: bool):
        self.path = path
        self.size_bytes = size_bytes
        self.owner = owner
        self._mmap: mmap.mmap | None = mapping
        self._view: memoryview | None = memoryview(mapping)

    @classmethod
    def create(cls, path: str, size_bytes: int, preallocate: bool = True) -> ShmSegment:
        """Creates the file `path` (it must not exist) of exactly `size_bytes`, mapped read-write.

        With `preallocate` (the default) the memory is reserved now: a full /dev/shm then fails
        here with SegmentError instead of killing the process with SIGBUS on a later write.
        The creator is the owner: `close()` unlinks the file.
        """
        if not isinstance(size_bytes, int) or size_bytes <= 0:
            raise SegmentError(f"size_bytes must be a positive integer, got {size_bytes!r}")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise SegmentError(f"cannot create segment file {path}: {e}") from None
        try:
            try:
                if preallocate:
                    os.posix_fallocate(fd, 0, size_bytes)
                else:
                    os.ftruncate(fd, size_bytes)
                mapping = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                os.unlink(path)
                raise SegmentError(
                    f"cannot size or map segment {path} ({size_bytes} bytes): {e}") from None
        finally:
            os.close(fd)  # the mapping keeps the file open
        return cls(path, size_bytes, mapping, owner=True)

    @classmethod
    def attach(cls, path: str) -> ShmSegment:
        """Maps the existing segment file `path` read-write (a same-host client); not the owner."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as e:
            raise SegmentError(f"cannot open segment file {path}: {e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size <= 0:
                raise SegmentError(f"{path} is not a non-empty regular file")
            try:
                mapping = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED,
                                    mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:
                raise SegmentError(f"cannot map segment {path}: {e}") from None
        finally:
            os.close(fd)
        return cls(path, st.st_size, mapping, owner=False)

    @property
    def closed(self) -> bool:
        return self._view is None

    def check_range(self, offset: int, size: int) -> None:
        """Raises SegmentBoundsError unless [offset, offset + size) lies inside the segment."""
        if offset < 0 or size < 0 or offset + size > self.size_bytes:
            raise SegmentBoundsError(
                f"range [{offset}, {offset + size}) outside segment {self.path} "
                f"of {self.size_bytes} bytes")

    def view(self, offset: int, size: int) -> memoryview:
        """A writable byte view of [offset, offset + size): no copy. Release it when done."""
        view = self._view
        if view is None:
            raise SegmentClosedError(f"segment {self.path} is closed")
        self.check_range(offset, size)
        return view[offset:offset + size]

    def close(self) -> None:
        """Unmaps the segment (and unlinks its file if this process created it). Idempotent.

        Views still alive keep the memory mapped until they are released; the file is gone at
        once, so no new process can attach it.
        """
        if self._view is None:
            return
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        view, mapping = self._view, self._mmap
        self._view = self._mmap = None
        view.release()
        try:
            mapping.close()
        except BufferError:
            # Views handed out are still alive: the mapping goes when the last one is released.
            pass

    def __enter__(self) -> ShmSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("owner" if self.owner else "attached")
        return f"ShmSegment({self.path!r}, {self.size_bytes} bytes, {state})"
