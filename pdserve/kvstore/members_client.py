"""Reaching the cluster's membership table (pdserve.v1.ClusterMembers) on whichever master leads.

Owns one call to the table: the masters in turn, the last one that answered first, then any a
standby names as the leader; a call that no master answers raises the last error. Used by
workers and routers (joining), routers (following) and the controller (moving workers, finding
routers). Must not decide what the table means; `master/members.py` does.
"""

from __future__ import annotations

import threading

import grpc

from pdserve.kvstore.channel import (ask_the_named_leader_next, call_metadata, check_cluster_id,
                                     make_store_channel)
from pdserve.proto import cluster_pb2 as cpb
from pdserve.proto import cluster_pb2_grpc as cpb_grpc

_CALL_TIMEOUT_S = 5.0
# Codes after which the next master is asked (a standby, a master restarting, none there).
_NEXT_MASTER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


class MembersClient:
    def __init__(self, masters: str, cluster_id: str = "") -> None:
        self.masters = [a.strip() for a in masters.split(",") if a.strip()]
        if not self.masters:
            raise ValueError("masters: need at least one host:port")
        self._metadata = call_metadata(check_cluster_id(cluster_id))
        self._lock = threading.Lock()
        self._leader = 0
        self._channels: list[grpc.Channel | None] = [None] * len(self.masters)

    def _stub(self, i: int) -> cpb_grpc.ClusterMembersStub:
        with self._lock:
            if self._channels[i] is None:
                self._channels[i] = make_store_channel(self.masters[i])
            return cpb_grpc.ClusterMembersStub(self._channels[i])

    def _call(self, method: str, request, timeout_s: float):
        order = [(self._leader + k) % len(self.masters) for k in range(len(self.masters))]
        last: grpc.RpcError | None = None
        while order:
            i = order.pop(0)
            try:
                out = getattr(self._stub(i), method)(request, timeout=timeout_s,
                                                     metadata=self._metadata)
            except grpc.RpcError as e:
                if e.code() not in _NEXT_MASTER:
                    raise
                last = e
                ask_the_named_leader_next(order, self.masters, e)
                continue
            self._leader = i
            return out
        assert last is not None
        raise last

    def join(self, address: str, kind: str, role: str = "", client_address: str = ""
             ) -> cpb.JoinResponse:
        return self._call("Join", cpb.JoinRequest(address=address, kind=kind, role=role,
                                                  client_address=client_address),
                          _CALL_TIMEOUT_S)

    def set_state(self, address: str, state: str, role: str = "", reason: str = "",
                  timeout_s: float = _CALL_TIMEOUT_S) -> cpb.ClusterMember:
        return self._call("SetMemberState", cpb.SetMemberStateRequest(
            address=address, state=state, role=role, reason=reason), timeout_s)

    def watch(self, after_version: int = 0, epoch: str = "", wait_s: float = 0.0
              ) -> cpb.MembersView:
        """The table once its version passes `after_version` in `epoch`, or after `wait_s`."""
        return self._call("WatchMembers", cpb.WatchMembersRequest(
            after_version=after_version, epoch=epoch, wait_s=wait_s),
            wait_s + _CALL_TIMEOUT_S)

    def close(self) -> None:
        with self._lock:
            for ch in self._channels:
                if ch is not None:
                    ch.close()
            self._channels = [None] * len(self.masters)
