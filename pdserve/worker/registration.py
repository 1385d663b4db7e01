"""A worker joining its routers by itself: `RouterControl.RegisterWorker`, then a heartbeat.

Owns one daemon thread per router: it waits until this worker's own gRPC server answers health
checks (a router that learns the worker may poll it at once), registers the worker's advertised
address and current role, retrying with capped exponential backoff until the router accepts,
then registers again every `heartbeat_s`. The router treats a repeat as a no-op, and a router
that restarted (and forgot its members) learns the worker again from the next one. The role is
read live at each call, so after a role switch the next heartbeat reports the new role.
Must not import the router package: it speaks only the generated stubs.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import grpc

from pdserve import rpc
from pdserve.core.identity import ROUTER, WORKER
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
_FIRST_RETRY_S = 0.2
_CALL_TIMEOUT_S = 5.0


class Registrar:
    def __init__(self, routers: list[str], advertised: str, local: str,
                 role: Callable[[], int], heartbeat_s: float = HEARTBEAT_S) -> None:
        """`advertised`: what the routers are told; `local`: where this process checks that its
        own server is up; `role()`: the role hosted now (a `worker_pb2.Role` value)."""
        self.advertised = advertised
        self.local = local
        self.role = role
        self.heartbeat_s = heartbeat_s
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(r,), name=f"register-{r}",
                                          daemon=True) for r in routers]

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

    def _run(self, router: str) -> None:
        if not self._wait_until_serving():
            return
        channel = rpc.make_channel(router, ROUTER)
        retry_s = _FIRST_RETRY_S
        last_ok: bool | None = None  # logged on a change only, not once per heartbeat or retry
        try:
            while not self._stop.is_set():
                try:
                    rpb_grpc.RouterControlStub(channel).RegisterWorker(
                        rpb.RegisterWorkerRequest(address=self.advertised, role=self.role()),
                        timeout=_CALL_TIMEOUT_S)
                except grpc.RpcError as e:
                    if last_ok is not False:
                        log.warning("registering with router %s failed (%s); retrying", router,
                                    e.code().name)
                    last_ok = False
                    # A fresh channel: gRPC's own reconnect backoff grows to minutes, far past
                    # ours, and would hide a router that is back.
                    channel.close()
                    channel = rpc.make_channel(router, ROUTER)
                    self._stop.wait(retry_s)
                    retry_s = min(retry_s * 2, self.heartbeat_s)
                    continue
                if last_ok is not True:
                    log.info("registered with router %s as %s", router, self.advertised)
                last_ok = True
                retry_s = _FIRST_RETRY_S
                self._stop.wait(self.heartbeat_s)
        finally:
            channel.close()
