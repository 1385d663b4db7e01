"""The master's vocabulary: typed errors and the small frozen values its API takes and returns.

Owns `SegmentSpec`, `Placement`, `ObjectInfo`, `Event`, `Record`, `Demotion`, `TierStats`, their
JSON forms, and the exception hierarchy. Must not hold behaviour beyond validation and
(de)serialisation; the core decides, these only carry.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from pdserve.kvstore.errors import MasterError, PutInProgress  # noqa: F401 - re-exported

TIERS = ("dram", "ssd")

# Event kinds (Event.kind).
NODE_JOINED = "node_joined"
NODE_DEAD = "node_dead"
STORED = "stored"
REMOVED = "removed"
EVICTED = "evicted"  # the object is gone: its last replica was evicted, lost or corrupt
REPLICA_DROPPED = "replica_dropped"  # one replica gone, the object still has others
DEMOTED = "demoted"  # a replica moved from DRAM to SSD on the same node
PROMOTED = "promoted"  # a replica moved back from SSD to DRAM on the same node (read again)


class InvalidArgument(MasterError, ValueError):
    """An argument is malformed; the message names it."""


class NotFound(MasterError, KeyError):
    """No committed object (or no such node / pending put) under that name."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class AlreadyExists(MasterError):
    """The key is already committed; keys are content hashes, so the value is the same."""


class NoSpace(MasterError):
    """No node can hold the object, even after eviction (RESOURCE_EXHAUSTED: retry later)."""


class UnknownNode(MasterError, KeyError):
    """The node is not registered (or was declared dead): it must register again."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class EventsLost(MasterError):
    """The bounded event log no longer holds events after the asked seq: resynchronise."""


class ClusterIdConflict(MasterError):
    """The journal belongs to another cluster than the one this master was started for."""


class RestoreError(MasterError):
    """A snapshot or journal record cannot be applied (corrupt, out of order, conflicting)."""


@dataclass(frozen=True)
class SegmentSpec:
    """A contiguous region a node contributes: DRAM (a shared-memory file) or an SSD file."""

    segment_id: str
    size_bytes: int
    tier: str
    shm_path: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.segment_id, str) or not self.segment_id:
            raise InvalidArgument(f"segment_id must be a non-empty string, got {self.segment_id!r}")
        if isinstance(self.size_bytes, bool) or not isinstance(self.size_bytes, int):
            raise InvalidArgument(f"segment size_bytes must be an integer, got {self.size_bytes!r}")
        if self.size_bytes <= 0:
            raise InvalidArgument(f"segment size_bytes must be positive, got {self.size_bytes}")
        if self.tier not in TIERS:
            raise InvalidArgument(f"segment tier must be one of {TIERS}, got {self.tier!r}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SegmentSpec:
        return cls(**d)


@dataclass(frozen=True)
class Placement:
    """Where one replica's bytes live: `size` bytes at `offset` of a node's segment."""

    node_id: str
    host_id: str
    data_address: str
    segment_id: str
    shm_path: str
    offset: int
    size: int
    tier: str
    ucx_address: str = ""  # the node's UCX listener; "" when it serves none

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Placement:
        return cls(**d)


@dataclass(frozen=True)
class ObjectInfo:
    """A committed object as a reader sees it; the lease keeps its bytes put until lease_until_s."""

    key: str
    size: int
    checksum: int
    replicas: tuple[Placement, ...]
    lease_until_s: float


@dataclass(frozen=True)
class Event:
    """One change a follower (the router's prefix index) may care about."""

    seq: int
    kind: str
    key: str
    node_ids: tuple[str, ...]
    reason: str = ""


@dataclass(frozen=True)
class Record:
    """One journal entry: a committed-state change, replayable by MasterCore.restore."""

    seq: int
    op: str
    fields: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"seq": self.seq, "op": self.op, "fields": self.fields}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Record:
        try:
            return cls(seq=int(d["seq"]), op=str(d["op"]), fields=dict(d["fields"]))
        except (KeyError, TypeError, ValueError) as e:
            raise RestoreError(f"malformed journal record {d!r}: {e}") from None


@dataclass(frozen=True)
class Demotion:
    """An order for the caller: copy `source` (DRAM) into `target` (SSD, same node), then
    call demote_done(key, node_id, now_s) — or demote_abort if the copy failed."""

    key: str
    source: Placement
    target: Placement


@dataclass(frozen=True)
class TierStats:
    tier: str
    capacity_bytes: int
    # Allocated bytes (lengths rounded up to alloc_align_bytes), pending puts included.
    used_bytes: int
    # Committed objects with at least one replica in this tier.
    objects: int
    # Replicas moved out of this tier by eviction (dropped or demoted), since this master started.
    evictions: int
    # Pending puts with a placement in this tier.
    pending: int
