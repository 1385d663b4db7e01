"""What a simulated cluster is: pool sizes, routing policies, admission, the controller, the
engine's scheduler limits, the KV store and the network.

Owns `SimConfig` and its validation (a bad value raises `SimConfigError` naming the field).
Must not run anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.controller.config import ControllerConfig
from pdserve.controller.policy import PolicyConfig
from pdserve.core.errors import ConfigError
from pdserve.router.admission import AdmissionConfig
from pdserve.router.config import RouterConfig
from pdserve.router.policy import DECODE_POLICIES, PREFILL_POLICIES
from pdserve.sim.trace import HASH_BLOCK_TOKENS

LINKS = ("per_worker", "shared")


class SimConfigError(ConfigError):
    """A simulator setting that cannot work; the message starts with the field."""


@dataclass(frozen=True)
class SimConfig:
    prefill_workers: int = 1
    decode_workers: int = 1
    prefill_policy: str = "kv_aware"
    decode_policy: str = "free_kv"
    # The router's admission (the live router's defaults bound one router at 256 requests in
    # flight; a simulated cluster of many workers is given room by default).
    admission: AdmissionConfig = field(
        default_factory=lambda: AdmissionConfig(max_in_flight=10_000_000))
    # Conditional disaggregation, as the live router's default: a decode worker caching all
    # but at most this many tokens of a prompt prefills the rest itself (0: never).
    max_local_prefill_tokens: int = RouterConfig.max_local_prefill_tokens
    controller: bool = False
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    tick_s: float = 1.0  # controller decision period
    # A flip whose drain outlasts this fails, as the live `Flipper`'s: the worker leaves both
    # pools (FAILED), finishes what it holds in its old role, and the controller re-admits it in
    # that role at its first tick `failed_readmit_s` later (the controller's defaults).
    drain_timeout_s: float = ControllerConfig.drain_timeout_s
    failed_readmit_s: float = ControllerConfig.failed_readmit_s
    # A decode worker's flip moves its running requests to the other decode workers with their
    # KV, rather than waiting for them to finish (the controller's `migrate`, also its balance).
    migrate: bool = ControllerConfig.migrate
    window_s: float = 30.0  # finished requests the controller's status window holds
    pressure_window_s: float = 5.0
    stats_interval_s: float = 1.0  # the router polls every worker's stats this often
    # The engine: token budget per step, batch size, KV block size (tokens) and blocks per
    # worker (None: the profile's kv_capacity_tokens / block_size).
    block_size: int = 16
    # Prompt tokens per prefix id in the trace's `block_hashes` (the Mooncake trace's 512; a
    # trace of prompts scaled down shares finer prefixes).
    prefix_block_tokens: int = HASH_BLOCK_TOKENS
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 4096
    max_waiting: int = 1_000_000
    kv_blocks: int | None = None
    prefix_caching: bool = True
    store_capacity_blocks: int = 10_000_000  # the shared KV store (0: no store)
    transport: str = "tcp"
    link: str = "per_worker"  # KV transfers share each decode worker's link, or one for all
    # Workers per host sharing its CPU cores (consecutive workers, prefill first), for profiles
    # that say `host_cores`; None: each worker computes alone (its own accelerator).
    workers_per_host: int | None = None
    host_background_threads: float = 0.0  # other work's runnable threads on each such host
    cold_start: bool = False  # workers pay the profile's startup_s before serving
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 200.0
    seed: int = 0

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, what: str) -> None:
            if not ok:
                raise SimConfigError(f"{name}: {what}, got {getattr(self, name)!r}")

        need(self.prefill_workers >= 0, "prefill_workers", "must be >= 0")
        need(self.decode_workers >= 1, "decode_workers", "must be >= 1")
        need(self.prefill_policy in PREFILL_POLICIES, "prefill_policy",
             f"must be one of {', '.join(PREFILL_POLICIES)}")
        need(self.decode_policy in DECODE_POLICIES, "decode_policy",
             f"must be one of {', '.join(DECODE_POLICIES)}")
        need(self.failed_readmit_s >= 0, "failed_readmit_s", "must be >= 0")
        need(self.max_local_prefill_tokens >= 0, "max_local_prefill_tokens", "must be >= 0")
        for name in ("tick_s", "drain_timeout_s", "window_s", "pressure_window_s",
                     "stats_interval_s",
                     "slo_ttft_ms", "slo_itl_ms"):
            need(getattr(self, name) > 0, name, "must be > 0")
        for name in ("block_size", "prefix_block_tokens", "max_num_seqs",
                     "max_num_batched_tokens", "max_waiting"):
            need(getattr(self, name) >= 1, name, "must be >= 1")
        need(self.kv_blocks is None or self.kv_blocks >= 1, "kv_blocks", "must be >= 1")
        need(self.workers_per_host is None or self.workers_per_host >= 1, "workers_per_host",
             "must be >= 1 (or None)")
        need(self.host_background_threads >= 0, "host_background_threads", "must be >= 0")
        need(self.store_capacity_blocks >= 0, "store_capacity_blocks", "must be >= 0")
        need(self.link in LINKS, "link", f"must be one of {', '.join(LINKS)}")
        need(self.prefill_workers + self.decode_workers >= 1, "prefill_workers",
             "the cluster needs a worker")
