"""A worker joining its cluster by itself, then a heartbeat.

Owns one daemon thread per place the worker joins: the cluster's membership table on the store
master (`ClusterMembers.Join`, the way every router learns the worker), and any routers named
directly (`RouterControl.RegisterWorker`, for a store without a master). Each thread waits
until this worker's own gRPC server answers health checks (a router that learns the worker may
poll it at once), joins with the worker's advertised address and current role, retrying with
capped exponential backoff until accepted, then joins again every `heartbeat_s`. A repeat is a
no-op, and a table or router that restarted (and forgot its members) learns the worker again
from the next one. The role is read live at each call, so after a role switch the next
heartbeat reports the new role. Must not import the router package: it speaks only the
generated stubs.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from pdserve import rpc
from pdserve.core.identity import ROUTER, WORKER
from pdserve.kvstore.master.members import WORKER_KIND
from pdserve.kvstore.members_client import MembersClient
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.wire import role_from_proto

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
_FIRST_RETRY_S = 0.2
_CALL_TIMEOUT_S = 5.0


class Registrar:
    def __init__(self, routers: list[str], advertised: str, local: str,
                 role: Callable[[], int], heartbeat_s: float = HEARTBEAT_S,
                 masters: str = "", cluster_id: str = "") -> None:
        """`routers`: routers to register with directly; `masters`: the store master(s) whose
        membership table to join ("": none); `advertised`: what they are told; `local`: where
        this process checks that its own server is up; `role()`: the role hosted now (a
        `worker_pb2.Role` value)."""
        self.advertised = advertised
        self.local = local
        self.role = role
        self.heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(f"router {r}", _RouterTarget(r)),
                                          name=f"register-{r}", daemon=True) for r in routers]
        if masters:
            self._threads.append(threading.Thread(
                target=self._run, args=("the cluster", _TableTarget(masters, cluster_id)),
                name="join-cluster", daemon=True))

    def start(self) -> "Registrar":
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=_CALL_TIMEOUT_S)

    def _wait_until_serving(self) -> bool:
        while not self._stop.is_set():
            try:
                rpc.wait_healthy(self.local, timeout_s=1.0, peer=WORKER)
                return True
            except TimeoutError:
                continue
        return False

    def _run(self, name: str, target) -> None:
        if not self._wait_until_serving():
            return
        retry_s = _FIRST_RETRY_S
        last_ok: bool | None = None  # logged on a change only, not once per heartbeat or retry
        try:
            while not self._stop.is_set():
                try:
                    target.join(self.advertised, self.role())
                except grpc.RpcError as e:
                    if last_ok is not False:
                        log.warning("joining %s failed (%s); retrying", name, e.code().name)
                    last_ok = False
                    target.reset()
                    self._stop.wait(retry_s)
                    retry_s = min(retry_s * 2, self.heartbeat_s)
                    continue
                if last_ok is not True:
                    log.info("joined %s as %s", name, self.advertised)
                last_ok = True
                retry_s = _FIRST_RETRY_S
                self._stop.wait(self.heartbeat_s)
        finally:
            target.close()


class _RouterTarget:
    """A router named directly: RegisterWorker."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.channel = rpc.make_channel(router, ROUTER)

    def join(self, address: str, role: int) -> None:
        rpb_grpc.RouterControlStub(self.channel).RegisterWorker(
            rpb.RegisterWorkerRequest(address=address, role=role), timeout=_CALL_TIMEOUT_S)

    def reset(self) -> None:
        # A fresh channel: gRPC's own reconnect backoff grows to minutes, far past ours, and
        # would hide a router that is back.
        self.channel.close()
        self.channel = rpc.make_channel(self.router, ROUTER)

    def close(self) -> None:
        self.channel.close()


class _TableTarget:
    """The cluster's membership table on the store master(s): Join."""

    def __init__(self, masters: str, cluster_id: str) -> None:
        self.client = MembersClient(masters, cluster_id)

    def join(self, address: str, role: int) -> None:
        self.client.join(address, WORKER_KIND, role_from_proto(role) or "")

    def reset(self) -> None:
        """Nothing to renew: the store's channels reconnect within a second by themselves."""

    def close(self) -> None:
        self.client.close()
