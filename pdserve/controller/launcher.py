"""Local launcher: start the embedded cluster (store, workers, router) as child processes.

Owns the children's lives: each is asked to die with its parent (`pdserve.lifecycle`, so a
killed `pdserve serve` leaves nothing behind), logs to its own file, and is declared up only when its gRPC health check
says SERVING. `stop()` sends SIGTERM to all, waits, and kills whatever is left.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from pdserve import rpc
from pdserve.lifecycle import child_env

@dataclass(frozen=True)
class ClusterSpec:
    model_path: str
    dtype: str = "float32"
    host: str = "127.0.0.1"
    router_port: int = 50051
    # The router's OpenAI-compatible HTTP API: None turns it off, 0 picks a free port
    # (LocalCluster.http_address says which).
    http_host: str = "127.0.0.1"
    http_port: int | None = 8000
    store_port: int = 50070
    worker_base_port: int = 50061
    prefill_workers: int = 1
    decode_workers: int = 1
    num_blocks: int = 1024
    block_size_tokens: int = 16
    max_num_batched_tokens: int = 2048
    store_capacity_bytes: int = 1 << 30  # the storage node's shared-memory DRAM segment
    ready_timeout_s: float = 300.0
    log_dir: str | None = None
    worker_ports: tuple[int, ...] | None = None  # explicit ports (prefill first); else base + i
    threads_per_worker: int | None = None  # None: split this machine's cores among the workers
    # The router's prefill policy (pdserve.router.config.ROUTING_CHOICES); "auto" is kv_aware
    # with 2+ prefill workers, its index fed by the workers' and the store's event streams.
    routing: str = "auto"
    # Speculative decoding on the decode workers ("": off; "ngram"; "eagle", "dflash" or
    # "dspark" with a trained drafter at draft_path).
    spec_method: str = ""
    draft_path: str = ""
    num_speculative_tokens: int = 4
    spec_schedule: bool = True  # the confidence scheduler (off: always verify whole drafts)
    # Progressive KV transfer on every worker (--progressive-kv): layer-wise anchor/residual
    # streaming through the store instead of whole blocks.
    progressive_kv: bool = False
    router_args: tuple[str, ...] = ()  # more flags for every router (e.g. --kv-fetch-weight 1)
    # The controller (pdserve.controller): flips roles and offloads prefill under SLO pressure.
    controller: bool = True
    controller_port: int = 50052
    controller_mode: str = "active"
    ttft_slo_ms: float = 2000.0
    itl_slo_ms: float = 200.0
    controller_args: tuple[str, ...] = ()  # more flags (e.g. --cooldown-s 5)

    def __post_init__(self) -> None:
        if self.controller_mode not in ("active", "advisory", "off"):
            raise ValueError(f"controller_mode must be active, advisory or off, got "
                             f"{self.controller_mode!r}")
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ValueError("prefill_workers and decode_workers must be >= 1")
        n = self.prefill_workers + self.decode_workers
        if self.worker_ports is not None and len(self.worker_ports) != n:
            raise ValueError(f"worker_ports: need {n} ports, got {len(self.worker_ports)}")

    def worker_threads(self) -> int:
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // (self.prefill_workers + self.decode_workers))

    def worker_port(self, i: int) -> int:
        return self.worker_ports[i] if self.worker_ports else self.worker_base_port + i


@dataclass
class Child:
    name: str
    address: str
    proc: subprocess.Popen
    log_path: str


@dataclass
class LocalCluster:
    spec: ClusterSpec
    children: list[Child] = field(default_factory=list)
    log_dir: str = ""
    http_address: str | None = None  # "host:port" of the OpenAI HTTP API once started
    controller_address: str | None = None  # "host:port" of the controller once started
    controller_metrics: str | None = None  # its Prometheus /metrics URL
    # Worker address -> its Prometheus /metrics URL (pdserve.metrics), once started.
    worker_metrics: dict = field(default_factory=dict)

    @property
    def router_address(self) -> str:
        return f"{self.spec.host}:{self.spec.router_port}"

    def _spawn(self, name: str, address: str, args: list[str]) -> Child:
        log_path = os.path.join(self.log_dir, f"{name}.log")
        log = open(log_path, "wb")
        proc = subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=child_env())
        log.close()
        child = Child(name, address, proc, log_path)
        self.children.append(child)
        return child

    def _wait(self, children: list[Child]) -> None:
        deadline = time.monotonic() + self.spec.ready_timeout_s
        for c in children:
            while True:
                if c.proc.poll() is not None:
                    raise RuntimeError(f"{c.name} exited with {c.proc.returncode} before it was "
                                       f"ready; its log ({c.log_path}) ends:\n{_tail(c.log_path)}")
                try:
                    rpc.wait_healthy(c.address, timeout_s=1.0)
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{c.name} at {c.address} not healthy after "
                                           f"{self.spec.ready_timeout_s}s; log {c.log_path}") from None

    def _wait_store_nodes(self, master_addr: str, nodes: list[Child]) -> None:
        from pdserve.proto import kvmaster_pb2 as pb
        from pdserve.proto import kvmaster_pb2_grpc as pb_grpc

        deadline = time.monotonic() + self.spec.ready_timeout_s
        with rpc.make_channel(master_addr) as ch:
            stub = pb_grpc.KVMasterStub(ch)
            while stub.Stats(pb.MasterStatsRequest(), timeout=5).nodes_alive < len(nodes):
                for c in nodes:
                    if c.proc.poll() is not None:
                        raise RuntimeError(f"{c.name} exited with {c.proc.returncode}; its log "
                                           f"({c.log_path}) ends:\n{_tail(c.log_path)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"storage nodes did not register with {master_addr}")
                time.sleep(0.1)

    def start(self) -> "LocalCluster":
        s = self.spec
        self.log_dir = s.log_dir or tempfile.mkdtemp(prefix="pdserve-")
        os.makedirs(self.log_dir, exist_ok=True)
        try:
            # The store: a master (metadata, journaled under the log dir) and one storage
            # node contributing a shared-memory DRAM segment of store_capacity_bytes.
            store_addr = f"{s.host}:{s.store_port}"
            master = self._spawn("kvmaster", store_addr, [
                "pdserve.kvstore.master", "--address", store_addr,
                "--journal-dir", os.path.join(self.log_dir, "kvmaster-journal")])
            node = self._spawn("kvnode-0", "", [
                # Unique per cluster: a node removes stale segment files of its own id at start.
                "pdserve.kvstore.node", "--node-id", f"node0-{s.store_port}",
                "--data-address", f"{s.host}:0",
                "--dram-bytes", str(s.store_capacity_bytes), "--master", store_addr])
            workers = []
            roles = ["prefill"] * s.prefill_workers + ["decode"] * s.decode_workers
            for i, role in enumerate(roles):
                addr = f"{s.host}:{s.worker_port(i)}"
                workers.append(self._spawn(f"{role}-{i}", addr, [
                    "pdserve.worker", "--role", role, "--model", s.model_path, "--address", addr,
                    "--store-address", store_addr, "--dtype", s.dtype,
                    "--num-blocks", str(s.num_blocks),
                    "--block-size-tokens", str(s.block_size_tokens),
                    "--max-num-batched-tokens", str(s.max_num_batched_tokens),
                    "--threads", str(s.worker_threads()), "--metrics-port", "0",
                    *(["--progressive-kv", "true"] if s.progressive_kv else []),
                    *(["--spec-method", s.spec_method, "--draft-path", s.draft_path,
                       "--num-speculative-tokens", str(s.num_speculative_tokens),
                       "--spec-schedule", str(s.spec_schedule)]
                      if s.spec_method and role == "decode" else [])]))
            self._wait([master])
            self._wait_store_nodes(store_addr, [node])
            self._wait(workers)
            for w in workers:  # each worker's Prometheus endpoint (a free port)
                self.worker_metrics[w.address] = self._ready_field(w, "metrics")
            prefill = ",".join(w.address for w in workers if w.name.startswith("prefill"))
            decode = ",".join(w.address for w in workers if w.name.startswith("decode"))
            http = [] if s.http_port is None else ["--http-host", s.http_host,
                                                   "--http-port", str(s.http_port)]
            # One request never holds more KV than a worker's pool: the router refuses longer
            # ones up front, and chat's default max_tokens (the rest of the context) fits.
            capacity = str(s.num_blocks * s.block_size_tokens)
            router = self._spawn("router", self.router_address, [
                "pdserve.router", "--model", s.model_path, "--address", self.router_address,
                "--prefill", prefill, "--decode", decode, "--max-model-len-tokens", capacity,
                *http, *self.routing_args(s.routing), *s.router_args])
            self._wait([router])
            if http:
                self.http_address = self._ready_field(router, "http")
            if s.controller:
                self.start_controller()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def audit_log(self) -> str:
        return os.path.join(self.log_dir, "controller-audit.jsonl")

    def start_controller(self, extra_args: tuple[str, ...] = ()) -> str:
        """Start the controller over this cluster's router; its address once healthy."""
        s = self.spec
        address = f"{s.host}:{s.controller_port}"
        child = self._spawn("controller", address, [
            "pdserve.controller", "--router", self.router_address, "--address", address,
            "--mode", s.controller_mode, "--ttft-slo-ms", str(s.ttft_slo_ms),
            "--itl-slo-ms", str(s.itl_slo_ms), "--audit-log", self.audit_log,
            "--metrics-port", "0", *s.controller_args, *extra_args])
        self._wait([child])
        self.controller_address = address
        self.controller_metrics = self._ready_field(child, "metrics")
        return address

    @property
    def store_address(self) -> str:
        return f"{self.spec.host}:{self.spec.store_port}"

    def worker_addresses(self, role: str) -> list[str]:
        """Addresses of the running workers started in `role` ("prefill" or "decode")."""
        return [c.address for c in self.children if c.name.startswith(f"{role}-")]

    def routing_args(self, routing: str) -> list[str]:
        return ["--routing", routing, "--block-size-tokens", str(self.spec.block_size_tokens),
                "--store-address", self.store_address]

    def add_router(self, name: str, port: int, routing: str, extra_args: tuple[str, ...] = ()
                   ) -> str:
        """Start one more router (gRPC only) over this cluster's workers, with its own policy
        and `extra_args` (e.g. admission bounds, an API key file); returns its address once
        healthy. `stop()` stops it with the rest."""
        address = f"{self.spec.host}:{port}"
        child = self._spawn(name, address, [
            "pdserve.router", "--model", self.spec.model_path, "--address", address,
            "--prefill", ",".join(self.worker_addresses("prefill")),
            "--decode", ",".join(self.worker_addresses("decode")), *self.routing_args(routing),
            "--max-model-len-tokens", str(self.spec.num_blocks * self.spec.block_size_tokens),
            *self.spec.router_args, *extra_args])
        self._wait([child])
        return address

    def stop_child(self, address: str, timeout_s: float = 10.0) -> None:
        """Stop the child serving `address` (e.g. a router from add_router)."""
        for c in [c for c in self.children if c.address == address]:
            c.proc.send_signal(signal.SIGTERM)
            try:
                c.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
            self.children.remove(c)

    def _ready_field(self, child: Child, key: str, timeout_s: float = 30.0) -> str:
        """`key=value` from the child's ready line (printed just after its gRPC is healthy)."""
        deadline = time.monotonic() + timeout_s
        pattern = re.compile(rf" ready on \S+ .*\b{key}=(\S+)")
        while True:
            with open(child.log_path, errors="replace") as f:
                m = pattern.search(f.read())
            if m:
                return m.group(1)
            if child.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{child.name} printed no ready line with {key}=; its log "
                                   f"({child.log_path}) ends:\n{_tail(child.log_path)}")
            time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        # Router first (no new requests), then workers, then the store they write to.
        for c in reversed(self.children):
            if c.proc.poll() is None:
                c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for c in self.children:
            try:
                c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.proc.kill()
                c.proc.wait()
        self.children.clear()

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _tail(path: str, n: int = 20) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return "(no log)"
