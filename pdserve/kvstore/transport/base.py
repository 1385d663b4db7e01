"""What every transport shares: the extent it moves bytes to or from, its interface, its errors.

Owns `Extent` (the data-plane view of one replica's placement: which node, where its data server
listens, which segment and byte range, which tier), the `Transport` protocol, the typed errors
and the buffer checks every transport does the same way. Must not open sockets or map memory.

The master's `Placement` maps field for field onto `Extent`; an SSD-tier replica's file on the
node is named by `Extent.ssd_object_id`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from pdserve.kvstore.node.protocol import Status

TIERS = ("dram", "ssd")


class TransportError(Exception):
    """Bytes could not be moved to or from a node (connection lost twice, bad buffer, ...)."""


class TransportUnavailable(TransportError):
    """This transport cannot serve this extent here (not installed, wrong tier, no shm path)."""


class RemoteError(TransportError):
    """The node answered with an error status; `status` says which."""

    def __init__(self, status: Status, message: str):
        super().__init__(f"{status.name}: {message}")
        self.status = status


class RemoteNotFound(RemoteError):
    """Unknown segment, unknown SSD object, or a node without an SSD tier."""


class RemoteOutOfRange(RemoteError):
    """The range lies outside the segment or object on the node."""


class RemoteNoSpace(RemoteError):
    """The node's SSD tier is full (RESOURCE_EXHAUSTED)."""


class RemoteBusy(RemoteError):
    """The node is at its connection limit; retry later."""


_REMOTE_ERRORS: dict[Status, type[RemoteError]] = {
    Status.NOT_FOUND: RemoteNotFound,
    Status.OUT_OF_RANGE: RemoteOutOfRange,
    Status.NO_SPACE: RemoteNoSpace,
    Status.BUSY: RemoteBusy,
}


def remote_error(status: int, message: str) -> RemoteError:
    """The typed error for a non-OK reply status."""
    try:
        known = Status(status)
    except ValueError:
        return RemoteError(Status.INTERNAL, f"unknown status {status}: {message}")
    return _REMOTE_ERRORS.get(known, RemoteError)(known, message)


@dataclass(frozen=True)
class Extent:
    """A byte range of one segment of one node: where one replica of an object lives."""

    node_id: str
    host_id: str
    data_address: str  # "host:port" of the node's data server
    segment_id: str
    shm_path: str  # the DRAM segment's shared-memory file; "" for the SSD tier
    offset: int
    size: int  # bytes reserved; a transfer may use a prefix of them
    tier: str = "dram"  # "dram" | "ssd"
    ucx_address: str = ""  # "host:port" of the node's UCX listener; "" if it serves none

    def __post_init__(self) -> None:
        if self.tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {self.tier!r}")
        if not isinstance(self.offset, int) or self.offset < 0:
            raise ValueError(f"offset must be a non-negative integer, got {self.offset!r}")
        if not isinstance(self.size, int) or self.size < 0:
            raise ValueError(f"size must be a non-negative integer, got {self.size!r}")

    @property
    def ssd_object_id(self) -> str:
        """The node-local SSD file of this extent: unique while the master holds the range."""
        return f"{self.segment_id}.{self.offset}"

    def sub(self, start: int, size: int) -> Extent:
        """The extent of bytes [start, start + size) of this one."""
        if start < 0 or size < 0 or start + size > self.size:
            raise ValueError(f"[{start}, {start + size}) outside an extent of {self.size} bytes")
        return replace(self, offset=self.offset + start, size=size)


@runtime_checkable
class Transport(Protocol):
    """Moves bytes between a local buffer and an extent; safe to share between threads."""

    def write(self, extent: Extent, src: memoryview) -> None:
        """Copies all of `src` to the start of `extent` (len(src) <= extent.size)."""

    def read_into(self, extent: Extent, dst: memoryview) -> None:
        """Fills `dst` from the start of `extent` (len(dst) <= extent.size)."""

    def close(self) -> None:
        """Releases connections and mappings; the transport is not used after."""


def byte_view(buf: object, extent: Extent, writable: bool) -> memoryview:
    """`buf` as a flat byte view that fits `extent`; TransportError if it cannot be one.

    Any C-contiguous buffer works (bytes, bytearray, mmap, numpy arrays, memoryviews); no copy.
    """
    try:
        view = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise TransportError(f"{type(buf).__name__} does not expose a buffer") from None
    if not view.c_contiguous:
        raise TransportError("buffer must be C-contiguous")
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError as e:
            raise TransportError(f"buffer of format {view.format!r} is not castable to bytes: "
                                 f"{e}") from None
    if writable and view.readonly:
        raise TransportError("destination buffer is read-only")
    if len(view) > extent.size:
        raise TransportError(f"{len(view)} bytes do not fit extent {extent.segment_id}"
                             f"@{extent.offset} of {extent.size} bytes")
    return view
