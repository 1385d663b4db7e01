"""Configuration of one worker process (one frozen dataclass, validated at the boundary)."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.roles import PREFILL, ROLES
from pdserve.engine.config import SPEC_METHODS, ConfigError
from pdserve.flags import flag
from pdserve.engine.device import DTYPE_CHOICES, check_quantization, parse_device
from pdserve.kvstore import config as store_config
from pdserve.kvstore.channel import check_cluster_id

# A step's token budget when none is set, by device. On an accelerator a bigger batch computes
# prefill faster per token. On a CPU it does not (a step's time is linear in its tokens), so a
# smaller budget gives the first prompts of a burst their first token sooner at the same
# throughput: a burst of 8 prompts of 256 tokens on one core got first tokens at 1.3, 2.5, 3.8
# and 5.0 s with 512 against 0.7 s for the first and 5.1 s for the other 7 with 2048.
STEP_TOKENS = {"cpu": 512, "accelerator": 2048}

CORE_SHARING = ("lend", "turns")  # `worker/cores.py`; the first is the default
ENGINES = ("model", "emulated")  # the real model; or `engine/emulated.py`, a load tool


@dataclass(frozen=True)
class WorkerConfig:
    model_path: str = flag(name="--model", help="model path (GGUF file or HF folder)")
    role: str = PREFILL  # PREFILL or DECODE; switchable at run time through SetRole
    address: str = "127.0.0.1:50061"
    store_address: str = "127.0.0.1:50080"  # the master(s), comma-separated; or a simple store
    # "distributed": the Mooncake-style store (master + storage nodes, pdserve.kvstore.master);
    # "simple": the single-process store of pdserve.kvstore.service (no replicas, no tiers).
    store_kind: str = "distributed"
    store_replicas: int = 1
    # This machine's identity for the store: equal to a storage node's host_id means shared
    # memory, different means the network (default: the hostname).
    host_id: str | None = None
    # The compute device: auto (a GPU when torch sees one), cpu, cuda or cuda:N (N counts
    # within CUDA_VISIBLE_DEVICES; the launcher gives each worker of a host its own GPU).
    device: str = "auto"
    dtype: str = "auto"  # auto: bfloat16 on a GPU, float32 on the CPU
    # "none", or "int8": projection weights int8 per output channel (CPU and float32 only;
    # opt-in, `pdserve bench quant` measures its accuracy). Part of the model id its KV carries.
    quantization: str = "none"
    block_size_tokens: int = 16
    num_blocks: int = 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 0  # a step's token budget; 0: by device (STEP_TOKENS)
    max_waiting: int = 256
    max_concurrent_rpcs: int = 256  # beyond this gRPC answers RESOURCE_EXHAUSTED
    rpc_threads: int = 64
    model_name: str | None = None
    # Compute threads for this worker (0: torch's default). Workers sharing a machine should
    # split its cores: two OpenMP pools on the same cores spin against each other and a step
    # can take many times longer.
    threads: int = 0
    # Cores lent between the workers of one host (`worker/cores.py`): the ledger file they
    # share ("": none, `threads` fixed), and the most threads a step may use while the host's
    # other workers idle (0: `threads`). Needs `threads` >= 1.
    core_ledger: str = ""
    max_threads: int = 0
    # How the ledger's workers share the cores: "turns" (a step on all of them, one worker's
    # step at a time) or "lend" (a step on its own share plus the idle cores, side by side).
    core_sharing: str = "lend"
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
    # Routers to register with directly, comma-separated host:port ("": none): for the simple
    # store, which has no master. With the distributed store the worker joins the cluster's
    # membership table on the master (every router follows it) once it serves, then again
    # every few seconds, so a table or router that restarts learns it again.
    register_with: str = ""
    # Join the cluster's membership table on the store master (the distributed store), which
    # every router follows. Off: only routers that name this worker (their --prefill and
    # --decode, or --register-with) send it requests, e.g. a worker set aside for one router.
    join_cluster: bool = True
    # host:port others reach this worker at ("": `address`, a wildcard host read as 127.0.0.1).
    advertise_address: str = ""
    # The cluster this worker belongs to ("": any). A store master of another cluster refuses
    # it: at start the worker exits 1 naming both ids; later, it serves without that store.
    cluster_id: str = ""
    # Seconds one store operation may spend retrying a master that does not answer (a restart,
    # a failover) before the worker serves without the store (degraded: the decode side
    # recomputes the KV); once one found no master, the next ones fail at once until one answers.
    store_retry_budget_s: float = 3.0
    # "model": the model's weights compute every step. "emulated": no weights are read (only
    # the model's shape and vocabulary); each step takes what the step-time `profile` (a
    # shipped name or a JSON file) says, tokens are deterministic, and KV blocks are the
    # profile's bytes per token times `kv_scale` (`engine/emulated.py`). A load tool.
    engine: str = flag("model", choices=ENGINES, help="model: the weights compute each step; "
                       "emulated: a step-time profile's timing, deterministic tokens (a load tool)")
    profile: str = flag("", help="the emulated engine's step-time profile: a shipped name "
                        "(cpu-smollm2-135m, h100-llama3-8b, ...) or a JSON file")
    kv_scale: float = flag(1.0, help="the emulated engine's KV bytes per token, as a fraction "
                           "of the profile's (so that a machine's memory holds the experiment)")

    @property
    def emulated(self) -> bool:
        return self.engine == "emulated"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be 'prefill' or 'decode', got {self.role!r}")
        if ":" not in self.address:
            raise ConfigError(f"address must be host:port, got {self.address!r}")
        if self.dtype not in DTYPE_CHOICES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got "
                              f"{self.dtype!r}")
        parse_device(self.device)  # a bad value raises, naming --device
        check_quantization(self.quantization, self.device, self.dtype)
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
        if self.max_num_batched_tokens < 0:
            raise ConfigError("max_num_batched_tokens must be >= 0 (0: by device), got "
                              f"{self.max_num_batched_tokens}")
        if self.max_threads < 0:
            raise ConfigError(f"max_threads must be >= 0, got {self.max_threads}")
        if self.core_sharing not in CORE_SHARING:
            raise ConfigError(f"core_sharing must be one of {', '.join(CORE_SHARING)}, got "
                              f"{self.core_sharing!r}")
        if self.core_ledger and self.threads < 1:
            raise ConfigError("core_ledger needs threads >= 1 (the worker's own share)")
        if self.max_threads and self.max_threads < self.threads:
            raise ConfigError(f"max_threads ({self.max_threads}) must be >= threads "
                              f"({self.threads})")
        if self.rpc_threads < 1 or self.max_concurrent_rpcs < 1:
            raise ConfigError("rpc_threads and max_concurrent_rpcs must be >= 1")
        if self.advertise_address and ":" not in self.advertise_address:
            raise ConfigError(f"advertise_address must be host:port, got "
                              f"{self.advertise_address!r}")
        if self.register_with and self.address.rpartition(":")[2] == "0":
            # Port 0 is known only once bound: neither the routers nor the health wait
            # before registering could be told it.
            raise ConfigError("register_with needs address with a fixed port, not 0")
        try:
            check_cluster_id(self.cluster_id)
        except store_config.ConfigError as e:
            raise ConfigError(str(e)) from None
        if not 0 <= self.store_retry_budget_s <= 60:
            raise ConfigError(f"store_retry_budget_s must be in [0, 60] seconds, got "
                              f"{self.store_retry_budget_s!r}")
        if self.engine not in ENGINES:
            raise ConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.emulated != bool(self.profile):
            raise ConfigError("profile is needed with engine emulated, and only there")
        if not 0 < self.kv_scale <= 1:
            raise ConfigError(f"kv_scale must be in (0, 1], got {self.kv_scale}")
        if self.emulated and (self.spec_method or self.progressive_kv):
            raise ConfigError("the emulated engine runs neither speculative decoding nor "
                              "progressive KV")
        if any(":" not in r for r in self.routers()):
            raise ConfigError(f"register_with must be host:port, comma-separated, got "
                              f"{self.register_with!r}")

    def routers(self) -> list[str]:
        """The router addresses of `register_with`."""
        return [r.strip() for r in self.register_with.split(",") if r.strip()]

    def local_address(self) -> str:
        """`address` as a client on this machine dials it."""
        host, _, port = self.address.rpartition(":")
        if host in ("", "0.0.0.0", "[::]", "::"):
            host = "127.0.0.1"  # a wildcard is where to listen, not where to connect
        return f"{host}:{port}"

    def advertised(self) -> str:
        """The address others reach this worker at."""
        return self.advertise_address or self.local_address()
