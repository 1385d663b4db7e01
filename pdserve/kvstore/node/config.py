"""Configuration of one storage node process: a frozen dataclass validated at construction.

Owns the node's settings and why a value is refused. Must not touch files, sockets or the
environment (the host id default is the command line's business).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pdserve.core.errors import ConfigError
from pdserve.flags import flag

_NODE_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}")




@dataclass(frozen=True)
class NodeConfig:
    """Settings of one storage node."""

    # Cluster-unique name; it prefixes segment ids and shm file names, so it is file-name safe.
    node_id: str = flag(help="cluster-unique, file-name safe")
    # Which machine this is: clients with the same host id map the segments instead of using TCP.
    host_id: str = flag(help="machine identity for same-host shared memory (default: hostname)")
    # Bytes of DRAM contributed, as one shared-memory segment.
    dram_bytes: int = flag(help="DRAM segment size")
    # Where the data server listens, "host:port" (port 0: any free port, reported when ready).
    data_address: str = flag("127.0.0.1:0", help=(
        "host:port of the data server (port 0: any free port)"))
    # Directory of the segment files: tmpfs, so that "files" are memory clients can map.
    shm_dir: str = flag("/dev/shm", help="directory of segment files")
    # SSD tier directory and byte budget; None / 0: no SSD tier.
    ssd_dir: str | None = flag(None, help="SSD tier directory (none: no SSD tier)")
    ssd_bytes: int = flag(0, help="SSD tier byte budget")
    # fsync each SSD object on commit (off: the store is a cache, a lost object is recomputed).
    ssd_fsync: bool = flag(False, switch=True, help="fsync SSD objects on commit")
    # Reserve the segment's memory at start, so a full /dev/shm fails now rather than SIGBUS later.
    preallocate: bool = True
    # Data connections served at once; one more is answered BUSY and closed.
    max_connections: int = flag(64, help="data connections served at once")
    # A request, once its first byte arrived, must complete within this many seconds.
    frame_timeout_s: float = flag(30.0, help="seconds one request may take once started")
    # Also serve the DRAM segment over UCX on this port (0: any free port; None: no UCX).
    ucx_port: int | None = flag(None, help=(
        "also serve the DRAM segment over UCX on this port (0: any free port); needs ucxx "
        "(pip install ucxx-cu12)"))
    # The process (`python -m pdserve.kvstore.node`), not the data server: the masters it
    # registers with and heartbeats (none: it serves unregistered), and its cluster, which a
    # master of another cluster refuses ("": any).
    masters: tuple[str, ...] = flag((), name="--master", help=(
        "comma-separated master addresses to register with and heartbeat"))
    heartbeat_s: float = 1.0
    cluster_id: str = flag("", help=(
        "the cluster this node belongs to; a master of another cluster refuses it ('': any)"))

    def __post_init__(self) -> None:
        if not isinstance(self.node_id, str) or not _NODE_ID.fullmatch(self.node_id):
            raise ConfigError(
                f"node_id must match [A-Za-z0-9_-][A-Za-z0-9._-]{{0,63}}, got {self.node_id!r}")
        if not isinstance(self.host_id, str) or not self.host_id:
            raise ConfigError(f"host_id must be a non-empty string, got {self.host_id!r}")
        if not isinstance(self.dram_bytes, int) or self.dram_bytes <= 0:
            raise ConfigError(f"dram_bytes must be a positive integer, got {self.dram_bytes!r}")
        host, sep, port = self.data_address.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ConfigError(f"data_address must be 'host:port', got {self.data_address!r}")
        if not self.shm_dir:
            raise ConfigError("shm_dir must be a directory path")
        if self.ssd_dir is not None:
            if not isinstance(self.ssd_bytes, int) or self.ssd_bytes <= 0:
                raise ConfigError(
                    f"ssd_bytes must be a positive integer with ssd_dir, got {self.ssd_bytes!r}")
        elif self.ssd_bytes:
            raise ConfigError("ssd_bytes given without ssd_dir")
        if not isinstance(self.max_connections, int) or self.max_connections < 1:
            raise ConfigError(
                f"max_connections must be an integer >= 1, got {self.max_connections!r}")
        if self.ucx_port is not None and (not isinstance(self.ucx_port, int)
                                          or not 0 <= self.ucx_port <= 65535):
            raise ConfigError(f"ucx_port must be an integer in [0, 65535], got {self.ucx_port!r}")
        if not self.frame_timeout_s > 0:
            raise ConfigError(f"frame_timeout_s must be > 0, got {self.frame_timeout_s!r}")
