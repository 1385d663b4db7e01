"""A storage node's membership with the master: register once, then heartbeat until stopped.

Owns the node side of liveness: a node the master no longer knows (declared dead after missing
heartbeats, or a master that restarted without it) registers again. Follows the leader among
several masters, and reaches a restarted one within a second (`kvstore.channel`). Sends the
node's cluster id with every call: a master of another cluster refuses it, `register` raises
ClusterMismatch and the heartbeat thread calls `on_refused(message)` and stops (a node no master
will have is of no use: its process exits). Must not touch segment bytes.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from pdserve.kvstore.channel import (ClusterMismatch, call_metadata, is_cluster_mismatch,
                                     make_store_channel)
from pdserve.kvstore.node.service import NodeInfo
from pdserve.proto import kvmaster_pb2 as pb
from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, info: NodeInfo, master_addresses: list[str],
                 heartbeat_s: float = 1.0, cluster_id: str = "",
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.info = info
        self.masters = master_addresses
        self.heartbeat_s = heartbeat_s
        self._metadata = call_metadata(cluster_id)
        self._on_refused = on_refused
        self.refused: str | None = None  # why a master refused this node, once one did
        self._stop = threading.Event()
        self._channels = [make_store_channel(a) for a in master_addresses]
        self._stubs = [pb_grpc.KVMasterStub(c) for c in self._channels]
        self._thread = threading.Thread(target=self._run, name="node-heartbeat", daemon=True)
        self._registered_once = False

    def _request(self) -> pb.RegisterNodeRequest:
        return pb.RegisterNodeRequest(
            node_id=self.info.node_id, host_id=self.info.host_id,
            data_address=self.info.data_address, ucx_address=self.info.ucx_address,
            segments=[pb.SegmentInfo(segment_id=s.segment_id, size_bytes=s.size_bytes,
                                     tier=s.tier, shm_path=s.shm_path)
                      for s in self.info.segments])

    def _each_master(self, fn) -> bool:
        """Call fn(stub) on masters until one (the leader) answers; True if one did.
        ClusterMismatch when a master serves another cluster."""
        for stub in self._stubs:
            try:
                fn(stub)
                return True
            except grpc.RpcError as e:
                if is_cluster_mismatch(e):
                    self.refused = e.details()
                    raise ClusterMismatch(e.details()) from None
                if e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.warning("master refused: %s %s", e.code().name, e.details())
        return False

    def register(self) -> bool:
        ok = self._each_master(lambda s: s.RegisterNode(self._request(), timeout=5,
                                                         metadata=self._metadata))
        self._registered_once = self._registered_once or ok
        return ok

    def _beat(self, stub) -> None:
        resp = stub.Heartbeat(pb.HeartbeatRequest(node_id=self.info.node_id), timeout=5,
                              metadata=self._metadata)
        if not resp.known:
            stub.RegisterNode(self._request(), timeout=5, metadata=self._metadata)

    def _run(self) -> None:
        # Register once; afterwards only heartbeat. A master that does not know us says so
        # (known=False) and we register again; a round where no master answers (a failover in
        # progress) must not make us register again: the master treats a re-registration as
        # a restarted node and drops its replicas.
        registered = self._registered_once
        while not self._stop.is_set():
            try:
                if registered:
                    self._each_master(self._beat)
                else:
                    registered = self.register()
            except ClusterMismatch as e:
                log.error("the store master refused this node: %s", e)
                if self._on_refused is not None:
                    self._on_refused(str(e))
                return
            self._stop.wait(self.heartbeat_s)

    def start(self) -> "Membership":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:  # started
            self._thread.join(timeout=5)
        for c in self._channels:
            c.close()
