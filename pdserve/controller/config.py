"""Configuration of the controller process (one frozen dataclass, validated at the boundary).

Owns the controller's knobs: where it listens and whom it steers, its mode, the SLOs the
pressures are measured against, the policy's hysteresis, flip timeouts, the audit log and the
keys an operator must present. Must not import torch or any service.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.errors import ConfigError
from pdserve.flags import flag

MODES = ("active", "advisory", "off")


@dataclass(frozen=True)
class ControllerConfig:
    router_address: str = flag("", name="--router", help=(
        "the control address of a router this controller steers (with --store: besides every "
        "router in the cluster's membership)"))
    # The store master(s) hosting the cluster's membership table: the controller moves workers
    # there (every router follows) and reads and steers every router listed there.
    store_address: str = flag("", name="--store", help=(
        "store master(s) hosting the cluster's membership: workers are moved there and every "
        "router listed there is read and steered"))
    address: str = "127.0.0.1:50052"
    # active: decides and acts; advisory: decides, logs and exports, never acts; off: neither.
    mode: str = "active"
    tick_s: float = 1.0
    # Defaults sized for SmolLM2-135M fp32 on a 2-core CPU (docs/benchmarks.md, bench fluid).
    ttft_slo_ms: float = 2000.0
    itl_slo_ms: float = 200.0
    ttft_share: float = 0.5  # share of the TTFT SLO the prefill queue may take
    window_s: float = 30.0  # finished requests counted in the attainment and ITL p90
    # Finished requests whose TTFT and ITL p90 feed the pressures: short, so a role stops
    # counting as pressured soon after its burst ends.
    pressure_window_s: float = 5.0
    # The two mechanisms (FluidRole flips whole workers; FluidToken offloads prefill work).
    fluid_role: bool = True
    fluid_token: bool = True
    # Running decodes move with their KV: off a decode worker that flips, and off the most
    # loaded decode worker when its step time threatens the ITL SLO. Off: they finish in place.
    migrate: bool = True
    # The decode step's shape for the projected pressure: a shipped step profile's name or a
    # profile file (`pdserve sim calibrate`), scaled online to the workers' own step times.
    # "": a line fitted to those step times alone, once they span a few batch sizes.
    step_profile: str = ""
    max_flips_per_tick: int = 1
    cooldown_s: float = 30.0
    min_per_role: int = 1
    sustain_s: float = 3.0
    drain_timeout_s: float = 60.0
    # A worker whose flip failed stays out of both pools this long, then is re-admitted in the
    # role it reports (if it answers and is not draining).
    failed_readmit_s: float = 30.0
    audit_log: str = ""  # JSONL of every decision ("" : none)
    audit_max_bytes: int = 64 << 20  # then rotated to .1 (one old file kept)
    metrics_port: int = -1  # Prometheus /metrics (0: a free port; -1: none)
    # Operator keys (lines `KEY NAME`); when set, every operator call needs one. Tenant keys
    # (`KEY TENANT`, the router's file) are recognised so they get PERMISSION_DENIED.
    admin_keys_file: str | None = None
    api_keys_file: str | None = None
    rpc_threads: int = 16

    def __post_init__(self) -> None:
        if not self.router_address and not self.store_address:
            raise ConfigError("router_address: a router to steer, or store_address, is required")
        if ":" not in self.address:
            raise ConfigError(f"address must be host:port, got {self.address!r}")
        if self.mode not in MODES:
            raise ConfigError(f"mode must be one of {MODES}, got {self.mode!r}")
        for f in ("tick_s", "ttft_slo_ms", "itl_slo_ms", "window_s", "pressure_window_s",
                  "drain_timeout_s"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be > 0, got {getattr(self, f)}")
        if not 0 < self.ttft_share <= 1:
            raise ConfigError(f"ttft_share must be in (0, 1], got {self.ttft_share}")
        for f in ("cooldown_s", "sustain_s", "failed_readmit_s"):
            if getattr(self, f) < 0:
                raise ConfigError(f"{f} must be >= 0, got {getattr(self, f)}")
        if self.max_flips_per_tick < 0 or self.min_per_role < 0:
            raise ConfigError("max_flips_per_tick and min_per_role must be >= 0")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be -1 (none) or a port, got {self.metrics_port}")
        if self.audit_max_bytes < 4096:
            raise ConfigError(f"audit_max_bytes must be >= 4096, got {self.audit_max_bytes}")
