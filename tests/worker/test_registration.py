"""A worker started with --register-with joins its routers by itself and keeps doing so.

The router's side of `RouterControl.RegisterWorker` is being built at the same time, so the
router here is a stand-in: a real gRPC server on loopback implementing the generated
`RouterControlServicer.RegisterWorker`, recording each call. The worker is a real process (with a
simple store process), and the stand-in is stopped and started again on the same port to play a
router that restarted and forgot its members.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from pdserve import rpc
from pdserve.core.errors import ConfigError
from pdserve.core.identity import ROUTER, WORKER
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.worker.config import WorkerConfig
from tests.helpers import free_port, process_output, start_process, stop_process

# The worker heartbeats every 5 s and backs off at most as long: a registration shows up
# well within this after anything changes.
WAIT_S = 20.0


class RecordingRouter(rpb_grpc.RouterControlServicer):
    """RegisterWorker only, recording (address, role) per call, on a real gRPC server."""

    def __init__(self, address: str) -> None:
        self.calls: list[tuple[str, int]] = []
        self._cond = threading.Condition()
        self.server = rpc.make_server(4)
        # As the router's control listener: TLS without client certificates, each call
        # authenticated (the worker proves its certificate per call).
        rpc.add_servicer(self.server, rpb_grpc.add_RouterControlServicer_to_server, self,
                         rpc.Guard(ROUTER, rpc.CONTROL))
        rpc.bind(self.server, address, ROUTER, rpc.CONTROL)
        self.server.start()

    def RegisterWorker(self, request, context):
        with self._cond:
            self.calls.append((request.address, request.role))
            self._cond.notify_all()
        return rpb.WorkerMember(address=request.address, role=request.role,
                                state=rpb.MEMBER_STATE_ACTIVE)

    def wait_for(self, call: tuple[str, int] | None = None, since: int = 0) -> int:
        """Waits for `call` (None: any call) among the calls from index `since` on; returns how
        many calls there are then."""
        with self._cond:
            assert self._cond.wait_for(
                lambda: (call in self.calls[since:]) if call else len(self.calls) > since,
                timeout=WAIT_S), f"no RegisterWorker{call} within {WAIT_S}s: {self.calls}"
            return len(self.calls)

    def stop(self) -> None:
        self.server.stop(None).wait()


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    store_addr = f"127.0.0.1:{free_port()}"
    store = start_process([sys.executable, "-m", "pdserve.kvstore", "--address", store_addr],
                          store_addr)
    router_addr = f"127.0.0.1:{free_port()}"
    port = free_port()
    # Listening on the wildcard: the worker must advertise a host others can dial.
    worker = start_process([sys.executable, "-m", "pdserve.worker", "--role", "decode",
                            "--model", tiny_llama_dir, "--address", f"0.0.0.0:{port}",
                            "--store-address", store_addr, "--store-kind", "simple",
                            "--num-blocks", "32", "--threads", "1",
                            "--register-with", f"{router_addr}, 127.0.0.1:{free_port()}"],
                           f"127.0.0.1:{port}", timeout_s=120)
    ch = rpc.make_channel(f"127.0.0.1:{port}", WORKER)
    yield router_addr, f"127.0.0.1:{port}", wpb_grpc.WorkerStub(ch), worker
    ch.close()
    assert stop_process(worker, timeout_s=15) == 0
    stop_process(store)


def failures(worker, router_addr: str) -> int:
    """How often the worker has logged a failed registration with `router_addr` (it logs
    each change from registered to failing once)."""
    out, err = process_output(worker)
    return (out + err).count(f"joining router {router_addr} failed")


def wait_for_failures(worker, router_addr: str, n: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while failures(worker, router_addr) < n:
        assert time.monotonic() < deadline, f"no failed registration #{n} within {WAIT_S}s"
        time.sleep(0.05)


def test_worker_registers_once_its_router_comes_up_and_again_after_a_restart(setup):
    router_addr, worker_addr, _, worker = setup
    # The worker has been serving (and retrying) before the router is up; the second router
    # in --register-with never comes up and must not hold the first one back.
    wait_for_failures(worker, router_addr, 1)
    router = RecordingRouter(router_addr)
    try:
        n = router.wait_for((worker_addr, wpb.ROLE_DECODE))
        # Then a heartbeat: registering again is how a router that forgot learns it back.
        router.wait_for(since=n)
    finally:
        router.stop()
    wait_for_failures(worker, router_addr, 2)  # a heartbeat has met the router down
    restarted = RecordingRouter(router_addr)
    try:
        restarted.wait_for((worker_addr, wpb.ROLE_DECODE))
    finally:
        restarted.stop()


def test_heartbeat_reports_the_role_after_a_switch(setup):
    router_addr, worker_addr, stub, _ = setup
    router = RecordingRouter(router_addr)
    try:
        router.wait_for((worker_addr, wpb.ROLE_DECODE))
        stub.SetRole(wpb.SetRoleRequest(role=wpb.ROLE_PREFILL, drain=True), timeout=30)
        router.wait_for((worker_addr, wpb.ROLE_PREFILL), since=len(router.calls))
        stub.SetRole(wpb.SetRoleRequest(role=wpb.ROLE_DECODE, drain=True), timeout=30)
        router.wait_for((worker_addr, wpb.ROLE_DECODE), since=len(router.calls))
    finally:
        router.stop()


def test_advertised_address_and_its_checks():
    cfg = WorkerConfig("m", address="0.0.0.0:7001", register_with="r:1")
    assert cfg.advertised() == "127.0.0.1:7001" and cfg.routers() == ["r:1"]
    assert WorkerConfig("m", address="[::]:7001").advertised() == "127.0.0.1:7001"
    assert WorkerConfig("m", address="10.1.2.3:7001").advertised() == "10.1.2.3:7001"
    cfg = WorkerConfig("m", address="0.0.0.0:7001", advertise_address="pod-3.workers:7001",
                       register_with="a:1,b:2")
    assert cfg.advertised() == "pod-3.workers:7001" and cfg.routers() == ["a:1", "b:2"]
    for bad in (dict(register_with="router"), dict(advertise_address="host"),
                dict(register_with="r:1", address="127.0.0.1:0")):
        with pytest.raises(ConfigError):
            WorkerConfig("m", **bad)


def test_registration_never_needs_the_router_package():
    # The worker speaks the generated stubs only: importing it must not pull the router in.
    code = ("import sys, pdserve.worker.registration, pdserve.worker.server; "
            "sys.exit(any(m.startswith('pdserve.router') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0
