"""Local launcher: start the embedded cluster (store, workers, router) as child processes.

Owns the children's lives: each is asked to die with its parent (`pdserve.lifecycle`, so a
killed `pdserve serve` leaves nothing behind), runs in a session of its own (a terminal's Ctrl-C
reaches only the launcher, which then stops them in order), logs to its own file, and is
declared up only when its gRPC health check says SERVING. Internal ports (store master,
workers, metrics, controller) are free ports picked at start unless given; the router's client
ports are checked free before anything starts. Every cluster gets an id (`--cluster-id`, in the
storage node's id and so in its shared-memory segment names), so clusters can share a host.
Every child gets the cluster's internal TLS (`cluster_tls.py`: `--tls-dir`, or
`--insecure-internal` when the spec says so); the launcher calls the children as the
cluster's operator.
With `ClusterSpec.supervise` (on in `pdserve serve`), a child that dies is restarted with the
same arguments (`supervision.py`; the router with the workers' current roles) and the launcher
serves its own Prometheus endpoint. `stop()` ends supervision, then stops the router (within
the shutdown grace), the controller, the workers, the storage node and the master in turn.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve import rpc
from pdserve.launcher.cluster_spec import ClusterSpec, check_free, free_ports
from pdserve.launcher.cluster_tls import Renewal, internal_tls, public_tls
from pdserve.launcher.commands import (command, controller_config, router_base, router_config,
                                       worker_config)
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.node.config import NodeConfig
from pdserve.router.config import RouterConfig
from pdserve.core.identity import CONTROLLER, MASTER, ROUTER, WORKER
from pdserve.core.roles import DECODE, PREFILL
from pdserve.security import cli as security_cli
from pdserve.launcher.supervision import Supervision, SupervisionCollector, tail
from pdserve.lifecycle import child_env

__all__ = ["ClusterSpec", "LocalCluster"]

SHM_DIR = "/dev/shm"  # where the storage node keeps its segment files (its default)
# The kind serving each child's probe address (the router's: its control listener).
_PEER = {"master": MASTER, "worker": WORKER, "router": ROUTER, "controller": CONTROLLER}


@dataclass(eq=False)
class Child:
    name: str
    kind: str  # master, node, worker, router or controller
    address: str
    proc: subprocess.Popen
    log_path: str
    argv: list[str]
    # Where the launcher checks it is up (its health), and which kind serves there: a
    # router's control listener (its client port may speak the operator's TLS).
    probe: str = ""
    started_s: float = 0.0  # time.monotonic() at its (re)start
    stopping: bool = False  # the launcher stops it on purpose: never restarted


@dataclass
class LocalCluster:
    spec: ClusterSpec  # once started: resolved (every port and the cluster id fixed)
    children: list[Child] = field(default_factory=list)
    log_dir: str = ""
    http_address: str | None = None  # "host:port" of the OpenAI HTTP API once started
    controller_address: str | None = None  # "host:port" of the controller once started
    controller_metrics: str | None = None  # its Prometheus /metrics URL
    # Worker address -> its Prometheus /metrics URL (pdserve.metrics), once started.
    worker_metrics: dict = field(default_factory=dict)
    metrics_url: str | None = None  # the launcher's own /metrics (restarts, liveness)
    supervision: Supervision | None = None
    # Set (e.g. by a signal handler) to abandon a start in progress: StartCancelled.
    cancel: threading.Event = field(default_factory=threading.Event)
    # This cluster's internal TLS as its operator (or Insecure), fixed by start().
    security: object = None
    renewal: Renewal | None = None  # the CA was made here: its certificates renewed
    # Every front-door router's control address (the first is router_control_address).
    router_controls: list = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _metrics_server: object = None

    @property
    def cluster_id(self) -> str:
        return self.spec.cluster_id

    @property
    def router_address(self) -> str:
        return f"{self.spec.host}:{self.spec.router_port}"

    @property
    def router_control_address(self) -> str:
        return f"{self.spec.host}:{self.spec.router_control_port}"

    @property
    def store_address(self) -> str:
        return f"{self.spec.host}:{self.spec.store_port}"

    @property
    def node_id(self) -> str:
        return f"node0-{self.spec.cluster_id}"

    @property
    def restarts(self) -> dict[str, int]:
        """Restarts so far by kind (master, node, worker, router, controller)."""
        return self.supervision.counts()["restarts"] if self.supervision else {}

    def _spawn(self, name: str, kind: str, address: str, args: list[str], probe: str = ""
               ) -> Child:
        log_path = os.path.join(self.log_dir, f"{name}.log")
        child = Child(name, kind, address, None, log_path, args,  # type: ignore[arg-type]
                      probe or address)
        self._popen(child, "wb")
        with self._lock:
            self.children.append(child)
        return child

    def _popen(self, child: Child, mode: str, note: str = "") -> None:
        with open(child.log_path, mode) as log:
            log.write(note.encode())
            log.flush()
            child.proc = subprocess.Popen(
                [sys.executable, "-m", *child.argv, *security_cli.forward(self.security)],
                stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env=child_env(), start_new_session=True)
        child.started_s = time.monotonic()

    def supervised(self) -> list[Child]:
        with self._lock:
            return [c for c in self.children if not c.stopping]

    def respawn(self, child: Child, exit_code: int, attempt: int) -> bool:
        """Start a dead child again with its arguments (a router with the workers' current
        roles), appending to its log so the crash stays readable above the restart. False if
        it is being stopped on purpose meanwhile."""
        if child.kind == "router" and child.probe in self.router_controls:
            child.argv = self._router_argv(self.current_roles(), child.probe)
        with self._lock:
            if child.stopping:
                return False
            self._popen(child, "ab", f"\n[pdserve serve] restarting {child.name} "
                                     f"(exit {exit_code}), attempt {attempt}\n")
            return True

    def current_roles(self, timeout_s: float = 1.0) -> dict[str, str]:
        """Worker address -> the role it hosts now (asked over gRPC; the role it was started
        in when it does not answer)."""
        import grpc

        from pdserve.proto import worker_pb2 as wpb
        from pdserve.proto import worker_pb2_grpc as wpb_grpc

        roles = {}
        for c in [c for c in self.supervised() if c.kind == "worker"]:
            roles[c.address] = c.name.rsplit("-", 1)[0]  # prefill-0, decode-1
            try:
                with rpc.make_channel(c.address, WORKER) as ch:
                    r = wpb_grpc.WorkerStub(ch).GetStats(wpb.GetStatsRequest(), timeout=timeout_s)
                roles[c.address] = {wpb.ROLE_PREFILL: PREFILL,
                                    wpb.ROLE_DECODE: DECODE}.get(r.role, roles[c.address])
            except grpc.RpcError:  # dead or busy: the role it was started in is the best guess
                pass
        return roles

    def _check_cancel(self) -> None:
        if self.cancel.is_set():
            raise StartCancelled("the start was cancelled (a stop signal arrived)")

    def _wait(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        for c in children:
            while True:
                self._check_cancel()
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with {c.proc.returncode} before it was "
                                       f"ready; its log ({c.log_path}) ends:\n{tail(c.log_path)}")
                try:
                    rpc.wait_healthy(c.probe, timeout_s=1.0, peer=_PEER[c.kind])
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{c.name} at {c.address} not healthy after "
                                           f"{self.spec.ready_timeout_s}s; log {c.log_path}") from None

    def _wait_store_nodes(self, master_addr: str, nodes: list[Child]) -> None:
        from pdserve.proto import kvmaster_pb2 as pb
        from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

        deadline = time.monotonic() + self.spec.ready_timeout_s
        with rpc.make_channel(master_addr, MASTER) as ch:
            stub = pb_grpc.KVMasterStub(ch)
            while stub.Stats(pb.MasterStatsRequest(), timeout=5).nodes_alive < len(nodes):
                self._check_cancel()
                for c in nodes:
                    if c.proc.poll() is not None:
                        raise RuntimeError(f"{c.name} exited with {c.proc.returncode}; its log "
                                           f"({c.log_path}) ends:\n{tail(c.log_path)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"storage nodes did not register with {master_addr}")
                time.sleep(0.1)

    def start(self) -> "LocalCluster":
        check_free(self.spec.host, self.spec.router_port, "the router's gRPC port")
        if self.spec.http_port:
            check_free(self.spec.http_host, self.spec.http_port, "the router's HTTP port")
        self.spec = s = self.spec.resolved()
        self.log_dir = s.log_dir or tempfile.mkdtemp(prefix="pdserve-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.security, owns_ca = internal_tls(s, self.log_dir)
        if owns_ca:
            self.renewal = Renewal(self.security.folder.path)
        try:
            # The store: a master (metadata, journaled under the log dir, one journal per
            # cluster id so a later `serve` with the same --log-dir starts afresh) and one
            # storage node contributing a shared-memory DRAM segment of store_capacity_bytes.
            master = self._spawn("kvmaster", "master", self.store_address, command(
                MasterConfig(address=self.store_address, cluster_id=s.cluster_id,
                             journal_dir=os.path.join(self.log_dir, "kvmaster-journal",
                                                      s.cluster_id))))
            # Unique per cluster: a node removes stale segment files of its own id at start.
            node = self._spawn("kvnode-0", "node", "", command(NodeConfig(
                node_id=self.node_id, host_id=socket.gethostname(), data_address=f"{s.host}:0",
                dram_bytes=s.store_capacity_bytes, masters=(self.store_address,),
                cluster_id=s.cluster_id)))
            workers = []
            roles = [PREFILL] * s.prefill_workers + [DECODE] * s.decode_workers
            metrics_ports = free_ports(len(roles))
            for i, role in enumerate(roles):
                addr = f"{s.host}:{s.worker_port(i)}"
                workers.append(self._spawn(f"{role}-{i}", "worker", addr, command(
                    worker_config(s, role, addr, self.store_address, metrics_ports[i],
                                  s.worker_threads(),
                                  device=s.worker_devices[i],
                                  **self._core_settings(s.worker_devices[i])))))
                self.worker_metrics[addr] = f"http://{s.host}:{metrics_ports[i]}/metrics"
            self._wait([master])
            self._wait_store_nodes(self.store_address, [node])
            self._wait(workers)
            self.router_controls = [self.router_control_address] + [
                f"{s.host}:{p}" for p in free_ports(s.routers - 1)]
            first = dict(zip((w.address for w in workers), roles))
            routers = [self._spawn("router" if i == 0 else f"router-{i}", "router",
                                   self.router_address, self._router_argv(first, control),
                                   probe=control)
                       for i, control in enumerate(self.router_controls)]
            self._wait(routers)
            if s.http_port is not None:
                self.http_address = self._ready_field(routers[0], "http")
            if s.controller:
                self.start_controller()
            if s.metrics_port is not None:
                self._serve_metrics()
            if s.supervise:
                self.supervision = Supervision(self, s.restart_policy).start()
            if self.renewal is not None:
                self.renewal.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _router_argv(self, roles: dict[str, str], control: str) -> list[str]:
        """A front-door router's command: the spec's client ports (shared with the other
        front doors when there are several), its own control listener at `control`."""
        s = self.spec
        http = None if s.http_port is None else f"{s.http_host}:{s.http_port}"
        return command(router_config(
            s, self.router_address, control, self.store_address, http,
            share_port=s.routers > 1,
            prefill_addresses=tuple(a for a, r in roles.items() if r == PREFILL),
            decode_addresses=tuple(a for a, r in roles.items() if r == DECODE),
            **public_tls(s)))

    def _serve_metrics(self) -> None:
        from pdserve.metrics import serve_worker

        collector = SupervisionCollector(
            lambda: self.supervision.counts() if self.supervision else
            {"restarts": {}, "gave_up": {}},
            lambda: [(c.name, c.kind, c.proc.poll() is None) for c in self.supervised()])
        self._metrics_server, port = serve_worker(collector, self.spec.host,
                                                  self.spec.metrics_port)
        self.metrics_url = f"http://{self.spec.host}:{port}/metrics"

    @property
    def audit_log(self) -> str:
        return os.path.join(self.log_dir, "controller-audit.jsonl")

    def start_controller(self, settings: Mapping[str, Any] | None = None) -> str:
        """Start the controller over this cluster's router, with `settings` (`ControllerConfig`
        fields) over the spec's; its address once healthy."""
        s = self.spec
        address = f"{s.host}:{s.controller_port}"
        [metrics_port] = free_ports(1)
        cfg = controller_config(s, address, self.router_control_address, self.store_address,
                                self.audit_log, metrics_port, **self._offload_settings())
        child = self._spawn("controller", "controller", address,
                            command(dataclasses.replace(cfg, **(settings or {}))))
        self._wait([child])
        self.controller_address = address
        self.controller_metrics = f"http://{s.host}:{metrics_port}/metrics"
        return address

    def worker_addresses(self, role: str) -> list[str]:
        """Addresses of the running workers started in `role` ("prefill" or "decode")."""
        return [c.address for c in self.children if c.name.startswith(f"{role}-")]

    def add_router(self, name: str, port: int, routing: str,
                   settings: Mapping[str, Any] | None = None) -> str:
        """Start one more router (gRPC only) over this cluster's workers, with its own policy,
        the spec's `router_settings` and `settings` over them (`RouterConfig` fields: e.g.
        admission bounds, an API key file); returns its address once healthy. `stop()` stops
        it with the rest."""
        address = f"{self.spec.host}:{port}"
        control = f"{self.spec.host}:{free_ports(1)[0]}"
        cfg = RouterConfig(**{
            **router_base(self.spec, address, control, self.store_address, routing),
            "prefill_addresses": tuple(self.worker_addresses(PREFILL)),
            "decode_addresses": tuple(self.worker_addresses(DECODE)),
            **self.spec.router_settings, **(settings or {})})
        child = self._spawn(name, "router", address, command(cfg), probe=control)
        self._wait([child])
        return address

    def stop_child(self, address: str, timeout_s: float = 10.0) -> None:
        """Stop the child serving `address` (e.g. a router from add_router)."""
        with self._lock:
            found = [c for c in self.children if c.address == address]
            for c in found:
                c.stopping = True
        _terminate(found, timeout_s)
        with self._lock:
            for c in found:
                self.children.remove(c)

    def _ready_field(self, child: Child, key: str, timeout_s: float = 30.0) -> str:
        """`key=value` from the child's latest ready line (printed once its gRPC is healthy)."""
        deadline = time.monotonic() + timeout_s
        pattern = re.compile(rf" ready on \S+ .*\b{key}=(\S+)")
        while True:
            self._check_cancel()
            with open(child.log_path, errors="replace") as f:
                found = pattern.findall(f.read())
            if found:
                return found[-1]
            if child.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} printed no ready line with {key}=; its log "
                                   f"({child.log_path}) ends:\n{tail(child.log_path)}")
            time.sleep(0.05)

    def _offload_settings(self) -> dict[str, Any]:
        """Workers taking turns on this host's CPU cores have no slack to lend each other: a
        prefill on a decode worker only takes turns from the prefill worker (in a c32 burst
        the controller had it prefill 29-token chunks on the same two cores, each a slower
        decode step). The controller offloads no prefill then; its flips stay."""
        turns = (self.spec.share_cores and self.spec.core_sharing == "turns"
                 and any(not d.startswith("cuda") for d in self.spec.worker_devices))
        return {"fluid_token": False} if turns else {}

    def _core_settings(self, device: str) -> dict[str, Any]:
        """A CPU worker's settings for lending cores (`worker/cores.py`): the cluster's ledger
        file, and up to all of this machine's cores while the others idle."""
        if not self.spec.share_cores or device.startswith("cuda"):
            return {}  # "auto": the worker lends only if it resolves to the CPU
        return {"core_ledger": os.path.join(self.log_dir, f"cores-{self.spec.cluster_id}"),
                "max_threads": self.spec.worker_max_threads(),
                "core_sharing": self.spec.core_sharing}

    def stop(self, timeout_s: float = 10.0) -> None:
        """Supervision first (an intended stop is never a restart), then the router, given the
        shutdown grace to finish its requests, then the controller, the workers, the storage
        node (it unlinks its segment) and the master, each kind within `timeout_s`."""
        if self.renewal is not None:
            self.renewal.stop()
        if self.supervision is not None:
            self.supervision.pause()
        with self._lock:
            children = list(self.children)
            for c in children:
                c.stopping = True
        grace = self.spec.shutdown_grace_s
        for kind, wait_s in (("router", grace + timeout_s), ("controller", timeout_s),
                             ("worker", timeout_s), ("node", timeout_s), ("master", timeout_s)):
            _terminate([c for c in children if c.kind == kind], wait_s)
        if self.spec.cluster_id:  # a node killed past its timeout could not unlink its segment
            for path in glob.glob(os.path.join(SHM_DIR, f"pdserve-{self.node_id}.*")):
                with contextlib.suppress(OSError):  # gone meanwhile
                    os.unlink(path)
        if self.supervision is not None:
            self.supervision.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
            self._metrics_server.server_close()
            self._metrics_server = None
        with self._lock:
            self.children.clear()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class StartCancelled(Exception):
    pass


def _terminate(children: list[Child], timeout_s: float) -> None:
    """SIGTERM to all of them, then SIGKILL to those still running after `timeout_s`."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
