"""A storage node's membership with the master: register once, then heartbeat until stopped.

Owns the node side of liveness: a node the master no longer knows (declared dead after missing
heartbeats, or a master that restarted without it) registers again. Follows the leader among
several masters. Must not touch segment bytes.
"""

from __future__ import annotations

import logging
import threading

import grpc

from pdserve import rpc
from pdserve.kvstore.node.service import NodeInfo
from pdserve.proto import kvmaster_pb2 as pb
from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, info: NodeInfo, master_addresses: list[str],
                 heartbeat_s: float = 1.0) -> None:
        self.info = info
        self.masters = master_addresses
        self.heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self._channels = [rpc.make_channel(a) for a in master_addresses]
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
        """Call fn(stub) on masters until one (the leader) answers; True if one did."""
        for stub in self._stubs:
            try:
                fn(stub)
                return True
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE,
                                    grpc.StatusCode.DEADLINE_EXCEEDED):
                    log.warning("master refused: %s %s", e.code().name, e.details())
        return False

    def register(self) -> bool:
        ok = self._each_master(lambda s: s.RegisterNode(self._request(), timeout=5))
        self._registered_once = self._registered_once or ok
        return ok

    def _beat(self, stub) -> None:
        resp = stub.Heartbeat(pb.HeartbeatRequest(node_id=self.info.node_id), timeout=5)
        if not resp.known:
            stub.RegisterNode(self._request(), timeout=5)

    def _run(self) -> None:
        # Register once; afterwards only heartbeat. A master that does not know us says so
        # (known=False) and we register again; a round where no master answers (a failover in
        # progress) must not make us register again: the master treats a re-registration as
        # a restarted node and drops its replicas.
        registered = self._registered_once
        while not self._stop.is_set():
            if registered:
                self._each_master(self._beat)
            else:
                registered = self.register()
            self._stop.wait(self.heartbeat_s)

    def start(self) -> "Membership":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for c in self._channels:
            c.close()
