"""What one local cluster is: the `ClusterSpec` the launcher starts, and picking its ports.

Owns the spec's fields and their checks (errors name the field), fixing a spec before start
(`resolved()`: every internal port unset becomes a free port, the cluster id a random one, so a
restarted child comes back at the same address; each worker's device is planned from the GPUs
visible without torch), and the port helpers: free ports, and a clear
error when a port the user asked for is taken. Must not start anything: `local.py` does.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.launcher.restart import RestartPolicy
from pdserve.core.errors import ConfigError
from pdserve.controller.config import ControllerConfig
from pdserve.router.config import RouterConfig
from pdserve.worker.config import CORE_SHARING
from pdserve.engine.device import (check_quantization, parse_device, plan_worker_devices,
                                   visible_gpus)


@dataclass(frozen=True)
class ClusterSpec:
    model_path: str
    dtype: str = "auto"  # auto: each worker's device's default (bfloat16 on a GPU)
    quantization: str = "none"  # every worker's (`WorkerConfig.quantization`): none or int8
    # Where the workers compute (pdserve.engine.device): auto, cpu, cuda or cuda:N. The
    # launcher gives each worker its own visible GPU (`worker_devices`, fixed by `resolved()`);
    # more workers than GPUs needs share_gpus.
    device: str = "auto"
    share_gpus: bool = False
    worker_devices: tuple[str, ...] | None = None  # prefill first; None: planned at start
    host: str = "127.0.0.1"
    router_port: int = 50051
    # Routers serving the same client ports (SO_REUSEPORT: the kernel spreads new connections
    # among them), each with its own control listener; all follow one membership.
    routers: int = 1
    # The router's OpenAI-compatible HTTP API: None turns it off, 0 picks a free port
    # (LocalCluster.http_address says which).
    http_host: str = "127.0.0.1"
    http_port: int | None = 8000
    store_port: int | None = None  # None: a free port, picked at start (as every internal port)
    worker_base_port: int | None = None  # workers on base + i; None: free ports
    prefill_workers: int = 1
    decode_workers: int = 1
    num_blocks: int = 1024
    block_size_tokens: int = 16
    max_num_batched_tokens: int = 0  # per-step token budget; 0: the worker's by its device
    store_capacity_bytes: int = 1 << 30  # the storage node's shared-memory DRAM segment
    ready_timeout_s: float = 300.0
    log_dir: str | None = None
    worker_ports: tuple[int, ...] | None = None  # explicit ports (prefill first); else base + i
    threads_per_worker: int | None = None  # None: split this machine's cores among the workers
    # CPU workers lend each other the cores they idle (`worker/cores.py`): a step runs on its
    # own `worker_threads()` plus the cores no other worker computes on at the moment.
    share_cores: bool = True
    core_sharing: str = "lend"  # how they share: "lend" or "turns" (`worker/cores.py`)
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
    # Every worker's engine (`WorkerConfig.engine`): "emulated" runs the step-time `profile`
    # with KV blocks of its bytes per token times `kv_scale` (`pdserve emulate`: a load tool).
    engine: str = "model"
    profile: str = ""
    kv_scale: float = 1.0
    # More settings of every router, by `RouterConfig` field (e.g. {"kv_fetch_weight": 1.0}),
    # over those the launcher gives it.
    router_settings: Mapping[str, Any] = field(default_factory=dict)
    # Router flags, passed only when set (None: the router's defaults).
    max_in_flight: int | None = None
    api_keys_file: str | None = None
    max_predicted_ttft_s: float | None = None
    max_local_prefill_tokens: int | None = None  # None: the router's default
    shutdown_grace_s: float = 30.0  # the router's grace on SIGTERM; stop() waits for it
    # The controller (pdserve.controller): flips roles and offloads prefill under SLO pressure.
    controller: bool = True
    controller_port: int | None = None  # None: a free port
    controller_mode: str = "active"
    ttft_slo_ms: float = 2000.0
    itl_slo_ms: float = 200.0
    # More settings of the controller, by `ControllerConfig` field (e.g. {"cooldown_s": 5.0}).
    controller_settings: Mapping[str, Any] = field(default_factory=dict)
    cluster_id: str = ""  # "": a random one at start
    # Internal TLS (`pdserve.security`): the cluster's TLS folder (a CA and a certificate per
    # kind); None: this process's own setting when it has one (PDSERVE_TLS_DIR), else a new
    # CA made at start in the log folder, renewed while the cluster runs. insecure_internal:
    # no TLS inside the cluster (plaintext; an explicit opt-in).
    tls_dir: str | None = None
    insecure_internal: bool = False
    router_control_port: int | None = None  # the router's control listener; None: a free port
    # TLS of the router's client APIs (gRPC and HTTP): files; "" for plaintext.
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""
    # Restart children that die (`pdserve serve` turns it on; tests that kill children on
    # purpose keep it off), and the launcher's own /metrics (0: a free port; None: none).
    supervise: bool = False
    restart_policy: RestartPolicy = RestartPolicy()
    metrics_port: int | None = 0

    def __post_init__(self) -> None:
        if self.routers < 1:
            raise ConfigError(f"routers must be >= 1, got {self.routers}")
        if self.controller_mode not in ("active", "advisory", "off"):
            raise ConfigError(f"controller_mode must be active, advisory or off, got "
                              f"{self.controller_mode!r}")
        if self.prefill_workers < 1 or self.decode_workers < 1:
            raise ConfigError("prefill_workers and decode_workers must be >= 1")
        n = self.prefill_workers + self.decode_workers
        if self.worker_ports is not None and len(self.worker_ports) != n:
            raise ConfigError(f"worker_ports: need {n} ports, got {len(self.worker_ports)}")
        if not re.fullmatch(r"[A-Za-z0-9_-]{0,32}", self.cluster_id):
            raise ConfigError(f"cluster_id: at most 32 of [A-Za-z0-9_-], got {self.cluster_id!r}")
        if self.worker_devices is not None and len(self.worker_devices) != n:
            raise ConfigError(f"worker_devices: need {n} devices, got {len(self.worker_devices)}")
        parse_device(self.device)  # a bad value raises, naming --device
        check_quantization(self.quantization, self.device, self.dtype)
        for device in self.worker_devices or ():
            check_quantization(self.quantization, device, self.dtype)
        if not self.shutdown_grace_s >= 0:
            raise ConfigError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if self.tls_dir and self.insecure_internal:
            raise ConfigError("tls_dir and insecure_internal exclude each other")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.core_sharing not in CORE_SHARING:
            raise ConfigError(f"core_sharing must be one of {', '.join(CORE_SHARING)}, got "
                              f"{self.core_sharing!r}")
        for name, cls in (("router_settings", RouterConfig),
                          ("controller_settings", ControllerConfig)):
            settings = getattr(self, name)
            known = {f.name for f in dataclasses.fields(cls)}
            bad = sorted(set(settings) - known)
            if bad:
                raise ConfigError(f"{name}: {cls.__name__} has no field {bad[0]!r}")
            object.__setattr__(self, name, dict(settings))  # a copy: the caller's may change

    def worker_threads(self) -> int:
        if self.threads_per_worker is not None:
            return self.threads_per_worker
        return max(1, (os.cpu_count() or 1) // (self.prefill_workers + self.decode_workers))

    def worker_max_threads(self) -> int:
        """The most threads a CPU worker's step may take: every core of this machine while
        the others idle (`share_cores`), else its own `worker_threads()`."""
        own = self.worker_threads()
        return max(own, len(os.sched_getaffinity(0))) if self.share_cores else own

    def worker_port(self, i: int) -> int:
        return self.worker_ports[i] if self.worker_ports else self.worker_base_port + i

    def resolved(self) -> "ClusterSpec":
        """This spec with its cluster id and every internal port fixed (free ports where
        unset), so that a restarted child comes back at the same address."""
        n = self.prefill_workers + self.decode_workers
        ports = iter(free_ports(n + 5))
        pick = (lambda p: p or next(ports))
        workers = self.worker_ports or (
            tuple(self.worker_base_port + i for i in range(n)) if self.worker_base_port
            else tuple(next(ports) for _ in range(n)))
        devices = self.worker_devices or tuple(plan_worker_devices(
            self.device, n, visible_gpus(), share=self.share_gpus))
        return dataclasses.replace(
            self, router_port=pick(self.router_port), store_port=pick(self.store_port),
            worker_ports=workers, worker_devices=devices,
            controller_port=pick(self.controller_port),
            router_control_port=pick(self.router_control_port),
            http_port=None if self.http_port is None else pick(self.http_port),
            cluster_id=self.cluster_id or uuid.uuid4().hex[:12])


def free_ports(n: int, rng: random.Random | None = None) -> list[int]:
    """`n` distinct TCP ports, free a moment ago (held together while picked).

    Drawn below the kernel's ephemeral range when it leaves room (10000 up to it): the kernel
    never hands those out to an outgoing connection or to another process's bind to port 0,
    so a port picked now is still free seconds later, when a child that first loads a model
    binds it. Otherwise, or when that range is crowded, the kernel's own picks. A port this
    process handed out in the last `_GIVEN_HOLD_S` is not handed out again: separate calls (a
    spec's worker ports, then its HTTP port) must not pick one port twice before either is
    bound."""
    rng = rng or random.Random()
    low = _ephemeral_low()
    socks: list[socket.socket] = []
    held: list[socket.socket] = []
    now = time.monotonic()
    with _GIVEN_LOCK:
        for port in [p for p, t in _GIVEN.items() if now - t > _GIVEN_HOLD_S]:
            del _GIVEN[port]
        given = set(_GIVEN)
    try:
        for _ in range(50 * n if low - _FIXED_LOW >= 1000 else 0):
            if len(socks) == n:
                break
            port = rng.randrange(_FIXED_LOW, low)
            if port in given:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind(("0.0.0.0", port))  # free on every address
                socks.append(s)
                given.add(port)
            except OSError:  # taken: draw again
                s.close()
        while len(socks) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("0.0.0.0", 0))
            # One handed out already stays bound (in `held`) while the kernel picks another.
            (held if s.getsockname()[1] in given else socks).append(s)
            given.add(s.getsockname()[1])
        ports = [s.getsockname()[1] for s in socks]
        with _GIVEN_LOCK:
            for port in ports:
                _GIVEN[port] = now
        return ports
    finally:
        for s in socks + held:
            s.close()


# Ports handed out by this process, when (time.monotonic()); bounded by pruning past the hold.
_GIVEN: dict[int, float] = {}
_GIVEN_LOCK = threading.Lock()
_GIVEN_HOLD_S = 120.0


_FIXED_LOW = 10000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: only the kernel's picks
        return _FIXED_LOW


class PortInUseError(RuntimeError):
    pass


def check_free(host: str, port: int, what: str) -> None:
    """Raises PortInUseError unless `host:port` can be bound (as the router would bind it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(f"{host}:{port} ({what}) is in use ({e.strerror}): another "
                                 f"pdserve serve may be running; choose another port") from None


def emulated_pools(workers: int, prefill: int | None) -> tuple[int, int]:
    """(prefill, decode) workers: `prefill` of them (default a quarter, at least one), the
    rest decode; at least one of each."""
    if workers < 2:
        raise ValueError("--workers must be >= 2 (one prefill and one decode worker at least)")
    k = max(1, workers // 4) if prefill is None else prefill
    if not 1 <= k < workers:
        raise ValueError(f"--prefill must be in [1, {workers - 1}] for {workers} workers, "
                         f"got {k}")
    return k, workers - k
