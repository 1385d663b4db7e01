"""Configuration of one worker process (one frozen dataclass, validated at the boundary)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import SPEC_METHODS, ConfigError


@dataclass(frozen=True)
class WorkerConfig:
    model_path: str
    role: str = "prefill"  # "prefill" or "decode"; switchable at run time through SetRole
    address: str = "127.0.0.1:50061"
    store_address: str = "127.0.0.1:50080"  # the master(s), comma-separated; or a simple store
    # "distributed": the Mooncake-style store (master + storage nodes, pdserve.kvstore.master);
    # "simple": the single-process store of pdserve.kvstore.service (no replicas, no tiers).
    store_kind: str = "distributed"
    store_replicas: int = 1
    # This machine's identity for the store: equal to a storage node's host_id means shared
    # memory, different means the network (default: the hostname).
    host_id: str | None = None
    dtype: str = "float32"
    block_size_tokens: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256
    max_concurrent_rpcs: int = 256  # beyond this gRPC answers RESOURCE_EXHAUSTED
    rpc_threads: int = 64
    model_name: str | None = None
    # Compute threads for this worker (0: torch's default). Workers sharing a machine should
    # split its cores: two OpenMP pools on the same cores spin against each other and a step
    # can take many times longer.
    threads: int = 0
    # Speculative decoding on this worker's decodes ("": off; "ngram": prompt lookup; "eagle",
    # "dflash", "dspark": a trained drafter at draft_path), with at most this many draft tokens
    # per request per step, cut by the confidence scheduler unless spec_schedule is off.
    spec_method: str = ""
    num_speculative_tokens: int = 4
    draft_path: str = ""
    spec_schedule: bool = True
    # Progressive KV transfer (docs/architecture.md): a prefill streams each layer's KV through
    # the store as it is computed (anchor planes first, residuals after; no whole blocks but a
    # cached prefix's), and a decode joins on the anchors and verifies once the residuals land.
    # Both ends of a transfer need it on. The sender queue is bounded in bytes (past it a
    # request falls back to whole blocks); a decode waits this long for a stream's objects
    # before recomputing what is missing.
    progressive_kv: bool = False
    progressive_queue_bytes: int = 256 << 20
    progressive_wait_ms: int = 30000
    # Prometheus /metrics on this port of the worker's host (0: a free port; -1: none).
    metrics_port: int = -1

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ConfigError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if ":" not in self.address:
            raise ConfigError(f"address must be host:port, got {self.address!r}")
        if self.store_kind not in ("distributed", "simple"):
            raise ConfigError(f"store_kind must be 'distributed' or 'simple', got {self.store_kind!r}")
        if self.store_replicas < 1:
            raise ConfigError("store_replicas must be >= 1")
        if self.spec_method not in ("", *SPEC_METHODS):
            raise ConfigError(f"spec_method must be '' or one of {', '.join(SPEC_METHODS)}, "
                              f"got {self.spec_method!r}")
        if self.spec_method not in ("", "ngram") and not self.draft_path:
            raise ConfigError(f"draft_path is required with spec_method {self.spec_method!r}")
        if self.num_speculative_tokens < 1:
            raise ConfigError("num_speculative_tokens must be >= 1")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port must be -1 (none) or a port, got {self.metrics_port}")
        if self.progressive_queue_bytes < 1 or self.progressive_wait_ms < 1:
            raise ConfigError("progressive_queue_bytes and progressive_wait_ms must be >= 1")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")
        if self.rpc_threads < 1 or self.max_concurrent_rpcs < 1:
            raise ConfigError("rpc_threads and max_concurrent_rpcs must be >= 1")
