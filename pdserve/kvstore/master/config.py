"""Configuration of the store master: one frozen dataclass validated at construction.

Owns the master's tunables (watermarks, lease and timeout lengths, eviction sampling, allocation
alignment, snapshot cadence, event log bound), the master process's settings (where it listens,
its journal or Redis, its leader lease, its cluster) and their validation. Must not read the
environment, open files or sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.errors import ConfigError
from pdserve.flags import flag

__all__ = ["ConfigError", "MasterConfig"]


@dataclass(frozen=True)
class MasterConfig:
    """Settings of the metadata master (see docs/kvstore.md, "Master core")."""

    # A tier's used bytes past this fraction of its capacity start eviction ...
    high_watermark: float = 0.90
    # ... which runs until used bytes are at or below this fraction.
    low_watermark: float = 0.85
    # How long a get keeps its object out of eviction (and its bytes in place).
    lease_s: float = 5.0
    # A put not committed within this long after put_start is reclaimed (so is a demotion).
    put_timeout_s: float = 30.0
    # A node silent for longer than this is declared dead and its replicas dropped.
    node_timeout_s: float = 10.0
    # 0: exact LRU (a heap over the candidates' last-touch times). N > 0: approximate LRU, the
    # oldest of a rotating window of N candidates per victim, for very many objects. On the
    # Mooncake conversation trace a 16-wide window kept far fewer reachable prefix blocks than
    # exact LRU (`pdserve bench kvstore --trace`), so exact is the default.
    eviction_sample: int = 0
    # A read of an object whose replicas are all on SSD moves one back to DRAM on its node
    # (asynchronously, like a demotion; the read itself is served from SSD).
    promote_on_read: bool = True
    # Every allocation's length (hence every offset) is a multiple of this.
    alloc_align_bytes: int = 4096
    # snapshot_due() turns true after this many journal records since the last snapshot.
    snapshot_every_ops: int = 1000
    # The event log keeps only the most recent this-many events (bounded memory).
    max_events: int = 10_000
    # The process (`python -m pdserve.kvstore.master`), not the core: where it serves, where
    # its metadata is journaled (a local folder, embedded; or Redis, which also elects the
    # leader among masters sharing it: distinct addresses, one `lease_key`), how often its
    # maintenance runs, and the cluster it serves (kept in its journal; "": any).
    address: str = "127.0.0.1:50080"
    journal_dir: str | None = flag(None, help="local journal (embedded default)")
    redis_url: str | None = flag(None, help="redis://host:port: journal + election")
    lease_key: str = "pdserve:kvstore:leader"
    leader_lease_s: float = 3.0
    tick_s: float = flag(0.5, help="maintenance period")
    cluster_id: str = flag("", help="the cluster this master serves (kept in its journal; "
                                    "'': any)")

    def __post_init__(self) -> None:
        for name in ("high_watermark", "low_watermark"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"{name} must be in (0, 1], got {value!r}")
        if not self.low_watermark < self.high_watermark:
            raise ConfigError(
                f"low_watermark must be below high_watermark, got low_watermark="
                f"{self.low_watermark!r} >= high_watermark={self.high_watermark!r}"
            )
        for name in ("lease_s", "put_timeout_s", "node_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a positive number of seconds, got {value!r}")
        if isinstance(self.eviction_sample, bool) or not isinstance(self.eviction_sample, int) \
                or self.eviction_sample < 0:
            raise ConfigError(f"eviction_sample must be an integer >= 0, got {self.eviction_sample!r}")
        for name in ("alloc_align_bytes", "snapshot_every_ops", "max_events"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
