"""The storage topology the master allocates from: live nodes, their segments, their free space.

Owns node records (host, data address, segments, last heartbeat), one ExtentAllocator per
segment, per-tier capacity and usage, and the choice of where replicas go (distinct nodes, most
free DRAM first). Must not know objects, leases or eviction; the core decides what to free.
Pure: no I/O, no clock (times are passed in).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.kvstore.master.allocator import ExtentAllocator
from pdserve.kvstore.master.model import TIERS, Placement, SegmentSpec


@dataclass
class NodeState:
    node_id: str
    host_id: str
    data_address: str
    segments: dict[str, SegmentSpec]  # registration order is first-fit order
    allocators: dict[str, ExtentAllocator] = field(default_factory=dict)
    last_seen_s: float = 0.0
    ucx_address: str = ""

    def free_bytes(self, tier: str) -> int:
        return sum(a.size_bytes - a.used_bytes for sid, a in self.allocators.items()
                   if self.segments[sid].tier == tier)

    def to_dict(self) -> dict:
        return {"node_id": self.node_id, "host_id": self.host_id,
                "data_address": self.data_address, "ucx_address": self.ucx_address,
                "segments": [s.to_dict() for s in self.segments.values()]}


class Cluster:
    def __init__(self, align_bytes: int) -> None:
        self.align_bytes = align_bytes
        self.nodes: dict[str, NodeState] = {}

    # -- membership --------------------------------------------------------------------------

    def add_node(self, node_id: str, host_id: str, data_address: str,
                 segments: list[SegmentSpec], now_s: float, ucx_address: str = "") -> None:
        assert node_id not in self.nodes
        node = NodeState(node_id, host_id, data_address, {s.segment_id: s for s in segments},
                         last_seen_s=now_s, ucx_address=ucx_address)
        for s in segments:
            node.allocators[s.segment_id] = ExtentAllocator(s.size_bytes, self.align_bytes)
        self.nodes[node_id] = node

    def drop_node(self, node_id: str) -> None:
        del self.nodes[node_id]

    # -- space ---------------------------------------------------------------------------------

    def length_of(self, size: int) -> int:
        return -(-size // self.align_bytes) * self.align_bytes

    def capacity(self, tier: str) -> int:
        return sum(s.size_bytes for n in self.nodes.values() for s in n.segments.values()
                   if s.tier == tier)

    def used(self, tier: str) -> int:
        return sum(a.used_bytes for n in self.nodes.values()
                   for sid, a in n.allocators.items() if n.segments[sid].tier == tier)

    def largest_segment(self) -> int:
        return max((s.size_bytes for n in self.nodes.values() for s in n.segments.values()),
                   default=0)

    def allocate_on(self, node_id: str, tiers: tuple[str, ...], size: int) -> Placement | None:
        """First fit over the node's segments, tier by tier in the order given."""
        node = self.nodes[node_id]
        for tier in tiers:
            for sid, seg in node.segments.items():
                if seg.tier != tier:
                    continue
                offset = node.allocators[sid].alloc(size)
                if offset is not None:
                    return Placement(node_id, node.host_id, node.data_address, sid,
                                     seg.shm_path, offset, size, tier,
                                     node.ucx_address if tier == "dram" else "")
        return None

    def place(self, size: int, count: int, tiers: tuple[str, ...],
              exclude: set[str]) -> list[Placement]:
        """Up to `count` fresh placements on distinct nodes not in `exclude`.

        Nodes with the most free DRAM are tried first (then most free SSD, then node id, so the
        choice is deterministic): DRAM is where reads are fastest and space is scarcest.
        """
        order = sorted((n for n in self.nodes.values() if n.node_id not in exclude),
                       key=lambda n: (-n.free_bytes("dram"), -n.free_bytes("ssd"), n.node_id))
        out: list[Placement] = []
        for node in order:
            if len(out) == count:
                break
            p = self.allocate_on(node.node_id, tiers, size)
            if p is not None:
                out.append(p)
        return out

    def reserve(self, p: Placement) -> bool:
        """Allocates exactly the extent `p` names (restore); False if the node, segment or
        range is unknown or taken."""
        node = self.nodes.get(p.node_id)
        if node is None or p.segment_id not in node.allocators:
            return False
        if node.segments[p.segment_id].tier != p.tier:
            return False
        return node.allocators[p.segment_id].reserve(p.offset, p.size)

    def free(self, p: Placement) -> None:
        """Frees the extent `p` holds; a no-op once its node is gone (its space went with it)."""
        node = self.nodes.get(p.node_id)
        if node is not None:
            node.allocators[p.segment_id].free(p.offset)

    def allocated_extents(self) -> set[tuple[str, str, int, int]]:
        """Every allocated extent as (node_id, segment_id, offset, length)."""
        return {(n.node_id, sid, off, ln) for n in self.nodes.values()
                for sid, a in n.allocators.items() for off, ln in a.allocated_extents()}

    def check(self) -> None:
        for n in self.nodes.values():
            for a in n.allocators.values():
                a.check()

    @staticmethod
    def tiers() -> tuple[str, ...]:
        return TIERS
