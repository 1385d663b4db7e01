"""One storage node's lifetime: make its segments and SSD tier, serve them, clean up.

Owns building the node from its `NodeConfig` under this process's internal TLS (`security`:
the data server's mutual TLS; UCX only with `--insecure-internal`), segment files named per
incarnation with a 128-bit random token (a name cannot be guessed; `segment` makes them O_EXCL,
mode 0600), the `NodeInfo` it would register with the master, and the segment files' lifetime:
every exit path that runs Python code unlinks them (SIGTERM and SIGINT, also the SIGTERM a
dying parent sends through `pdserve.lifecycle`; a normal return; an exception during start-up
or in `on_ready`, e.g. a master of another cluster refusing the registration). SIGKILL cannot
be caught: the next start of the same node id removes the files its killed predecessor left.
Must not parse arguments or print (that is `__main__`), nor hold object metadata.

`serve` calls `on_ready(info)` once the data server listens (`__main__` registers with the master
there and heartbeats until the stop signal), and `on_stop()` once a stop signal came, before
the node stops serving (`__main__` says NOT_SERVING there).
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import asdict, dataclass
from typing import Callable

from pdserve.kvstore.node.config import NodeConfig
from pdserve.kvstore.node.data_server import DataServer
from pdserve.kvstore.node.segment import SegmentError, ShmSegment
from pdserve.kvstore.node.ssd import SsdError, SsdTier
from pdserve.rpc import catch_stop_signals, wait_for_signal
from pdserve.security import tls

# The incarnation token's bytes (hex: twice as many digits). 128 random bits: a segment file's
# name cannot be guessed by another local user (nor found by a stale placement).
INCARNATION_BYTES = 16
UCX_NEEDS_INSECURE = ("--ucx-port needs --insecure-internal: UCX carries KV bytes in plaintext "
                      "and unauthenticated, and internal TLS is on (--tls-dir)")


class NodeStartError(Exception):
    """The node could not start (segment, SSD directory or address); nothing is left behind."""


@dataclass(frozen=True)
class SegmentInfo:
    """One segment as the master registers it: `(segment_id, size_bytes, tier, shm_path)`."""

    segment_id: str
    size_bytes: int
    tier: str  # "dram" | "ssd"
    shm_path: str  # "" for the SSD tier


@dataclass(frozen=True)
class NodeInfo:
    """What a node tells the master about itself when it registers."""

    node_id: str
    host_id: str
    data_address: str
    segments: tuple[SegmentInfo, ...]
    ucx_address: str = ""  # "" when the node serves no UCX

    def to_json_dict(self) -> dict:
        return asdict(self)


class StorageNode:
    """A node's segments, SSD tier and data server, started and stopped together, as
    `security` says (default: this process's setting, `tls.current()`)."""

    def __init__(self, config: NodeConfig, security: tls.Security | None = None):
        self.config = config
        self.security = security if security is not None else tls.current()
        # A fresh token per start: a restarted node's segments get new ids and file names, so a
        # stale placement fails NOT_FOUND instead of reading another incarnation's bytes.
        self.incarnation = secrets.token_hex(INCARNATION_BYTES)
        self._segments: dict[str, ShmSegment] = {}
        self._ssd: SsdTier | None = None
        self._server: DataServer | None = None
        self._ucx_server = None
        self.info: NodeInfo | None = None

    def start(self) -> NodeInfo:
        """Creates the DRAM segment (and SSD tier), starts the data server; NodeStartError."""
        c = self.config
        infos: list[SegmentInfo] = []
        self._remove_stale_segments()
        try:
            dram_id = f"{c.node_id}.{self.incarnation}.dram0"
            path = os.path.join(c.shm_dir, f"pdserve-{dram_id}")
            self._segments[dram_id] = ShmSegment.create(path, c.dram_bytes, c.preallocate)
            infos.append(SegmentInfo(dram_id, c.dram_bytes, "dram", path))
            if c.ssd_dir is not None:
                # The master drops a restarted node's replicas, so files of an earlier run would
                # be orphans holding budget: start empty, in a directory of this node's own.
                directory = os.path.join(c.ssd_dir, f"pdserve-{c.node_id}")
                self._ssd = SsdTier(directory, c.ssd_bytes, fsync=c.ssd_fsync, adopt=False)
                infos.append(SegmentInfo(f"{c.node_id}.{self.incarnation}.ssd", c.ssd_bytes,
                                         "ssd", ""))
            self._server = DataServer(self._segments, self._ssd, c.data_address,
                                      max_connections=c.max_connections,
                                      frame_timeout_s=c.frame_timeout_s,
                                      security=self.security)
            address = self._server.start()
            ucx_address = self._start_ucx(address) if c.ucx_port is not None else ""
        except (SegmentError, SsdError, OSError) as e:
            self.stop()
            raise NodeStartError(f"node {c.node_id}: {e}") from None
        except BaseException:  # anything else (NodeStartError, KeyboardInterrupt): no file left
            self.stop()
            raise
        self.info = NodeInfo(c.node_id, c.host_id, address, tuple(infos), ucx_address)
        return self.info

    def _start_ucx(self, data_address: str) -> str:
        """Serves the DRAM segment over UCX too, on the data server's host; its address."""
        from pdserve.kvstore.node.ucx_server import UcxDataServer  # imports ucxx: only if asked
        from pdserve.kvstore.transport.ucx import ucx_available

        if not self.security.insecure:
            raise NodeStartError(f"node {self.config.node_id}: {UCX_NEEDS_INSECURE}")
        if not ucx_available():
            raise NodeStartError(f"node {self.config.node_id}: ucx_port is set but ucxx is not "
                                 "installed (pip install ucxx-cu12) or PDSERVE_UCX=0")
        host = data_address.rpartition(":")[0].strip("[]")
        self._ucx_server = UcxDataServer(self._segments, host, self.config.ucx_port or 0,
                                         self.config.max_connections, security=self.security)
        return self._ucx_server.start()

    def _remove_stale_segments(self) -> None:
        """Unlink segment files an earlier incarnation of this node left behind (killed with
        -9, it could not). Node ids are cluster-unique and the master dropped that incarnation's
        replicas when this one registers, so nothing can still need them. Only names of exactly
        this id's form are touched (`pdserve-<id>.<incarnation>.dram<n>`, the incarnation 32 hex
        digits, or 8 as nodes before 128-bit tokens named them), never another id's that merely
        starts the same ("a" vs "a.b")."""
        mine = re.compile(rf"pdserve-{re.escape(self.config.node_id)}"
                          r"\.(?:[0-9a-f]{32}|[0-9a-f]{8})\.dram\d+")
        try:
            names = os.listdir(self.config.shm_dir)
        except OSError:
            return
        for name in names:
            if mine.fullmatch(name):
                try:
                    os.unlink(os.path.join(self.config.shm_dir, name))
                except OSError:
                    pass  # gone already, or not ours to remove

    def stop(self) -> None:
        """Stops serving, then unmaps and unlinks every segment. Idempotent."""
        if self._ucx_server is not None:
            self._ucx_server.stop()
            self._ucx_server = None
        if self._server is not None:
            self._server.stop()
            self._server = None
        segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()

    def __enter__(self) -> StorageNode:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(config: NodeConfig, on_ready: Callable[[NodeInfo], None],
          on_stop: Callable[[], None] | None = None,
          security: tls.Security | None = None) -> None:
    """Runs a node until SIGTERM/SIGINT; `on_ready(info)` once it serves, `on_stop()` once it
    is stopping (also when `on_ready` raises). NodeStartError."""
    catch_stop_signals()  # before announcing readiness, so an early SIGTERM still cleans up
    node = StorageNode(config, security)
    info = node.start()
    try:
        on_ready(info)
        wait_for_signal()
    finally:
        if on_stop is not None:
            on_stop()
        node.stop()
