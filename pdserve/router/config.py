"""Configuration of the router process.

Owns one frozen dataclass, validated at the boundary with errors naming the field. Must not
start anything: `server.py` builds the process from it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from pdserve.core.errors import ConfigError
from pdserve.flags import flag
from pdserve.router.policy import DECODE_POLICIES, PREFILL_POLICIES

DECODE_STREAMS = ("shared", "per_request")

ROUTING_CHOICES = ("auto", *PREFILL_POLICIES)
# Handler threads beyond max_in_flight by default, and at least: every admitted request holds a
# thread for its whole stream, and the spare ones answer refusals, health checks and control
# calls at once. With fewer, calls past the threads would wait in gRPC's queue, where no bound
# and no metric sees them, and admission would never refuse anything.
RPC_SPARE_THREADS = 32
MIN_SPARE_THREADS = 4
# Default bounds past the in-flight one: HTTP connections, and gRPC calls queued for a thread
# (each answered by admission in microseconds), both at least this many.
MIN_BURST = 256


@dataclass(frozen=True)
class RouterConfig:
    model_path: str = flag(name="--model", help="model path (GGUF file or HF folder)")
    # The first members of each pool; either may be empty (workers can register later through
    # RouterControl). A worker reporting another role than its list says is moved by its poll.
    prefill_addresses: tuple[str, ...] = flag((), name="--prefill", help=(
        "comma-separated prefill workers to start with (more may register)"))
    decode_addresses: tuple[str, ...] = flag((), name="--decode", help=(
        "comma-separated decode workers to start with (more may register)"))
    address: str = flag("127.0.0.1:50051", help="the client APIs (gRPC)")  # gRPC Generation
    # RouterControl (membership, offload budgets, signals): its own listener, TLS, every call
    # authenticated (a cluster identity or an admin key). Port 0: a free one (`control=` in
    # the ready line). Keep it off the public network: workers and the controller reach it.
    control_address: str = flag("127.0.0.1:0", help=(
        "the control API for workers, the controller and operators (TLS, each call "
        "authenticated; port 0: a free one, printed as control=)"))
    # The client ports (gRPC, HTTP) bound with SO_REUSEPORT: several routers on one host serve
    # the same ports and the kernel spreads new connections among them (`serve --routers N`).
    share_port: bool = flag(False, switch=True, help=(
        "share the client ports with other routers on this host (SO_REUSEPORT)"))
    # Where the controller reaches this router's control API, told to the cluster's
    # membership table ("": the control address, a wildcard host read as 127.0.0.1).
    advertise_control_address: str = flag("", help=(
        "host:port the cluster reaches the control API at (default: the control address)"))
    # `KEY [NAME]` lines: keys that may steer the router's control API without a certificate.
    admin_keys_file: str | None = flag(None, help=(
        "file of 'KEY [NAME]' lines: keys that may use the control API"))
    # TLS of the client APIs (gRPC and HTTP): certificate and key files, and a CA whose client
    # certificates are then required. "": plaintext.
    tls_cert: str = flag("", help="TLS certificate of the client APIs")
    tls_key: str = flag("", help="its private key")
    tls_client_ca: str = flag("", help=(
        "require client certificates from this CA on the client APIs"))
    model_name: str | None = None  # the id clients send in `model`; defaults to the file's name
    dtype: str = "float32"
    max_model_len_tokens: int | None = None
    # None: derived from max_in_flight (see __post_init__ and `RPC_SPARE_THREADS`).
    rpc_threads: int | None = flag(None, help=(
        "gRPC handler threads (default: max-in-flight + 32; at least max-in-flight + 4)"))
    # The bound on gRPC calls running or queued; past it a call is refused at once
    # (RESOURCE_EXHAUSTED with a retry hint) before admission sees it, so it sits far above
    # what admission lets in.
    max_concurrent_rpcs: int | None = flag(None, help=(
        "gRPC calls running or queued before the server refuses them unseen (default: "
        "derived; at least rpc-threads + http-max-connections)"))
    request_timeout_s: float = 600.0
    # Prefill policy: round_robin, least_loaded, power_of_two, kv_aware; "auto" is round_robin
    # with exactly one initial prefill worker (nothing to choose between), kv_aware otherwise
    # (2+, or none yet: workers will register).
    routing: str = flag("auto", choices=ROUTING_CHOICES, help=(
        "prefill routing policy (auto: kv_aware with 2+ prefill workers)"))
    # free_kv, least_loaded, round_robin or power_of_two
    decode_routing: str = flag("free_kv", choices=DECODE_POLICIES)
    # "shared": one DecodeMany stream per decode worker carries all of this router's requests
    # there (a step's tokens for them in one message); "per_request": a Decode call each.
    decode_streams: str = flag("shared", choices=DECODE_STREAMS, help=(
        "shared: one stream per decode worker for all requests (a step's tokens in one "
        "message); per_request: a Decode call per request"))
    # Must equal the workers' block size: the router hashes prompts as their engines do (a
    # worker reporting another size counts as caching nothing).
    block_size_tokens: int = flag(16, help=(
        "the workers' KV block size (prompts are hashed with it)"))
    # Conditional disaggregation (`local_prefill.py`): a prompt an ACTIVE decode worker caches
    # all but at most this many tokens of (at least one block cached) is prefilled and decoded
    # there, skipping the prefill worker and the store. 0: off. 64 tokens: a chat's next turn
    # of a sentence or two; on the embedded CPU default it raised c8 and c32 output tokens/s
    # about 1.2x and cut TTFT p50 by 43-56 % (docs/benchmarks.md, bench serve). NVIDIA Dynamo's
    # router makes the same choice by a length bound.
    max_local_prefill_tokens: int = flag(64, help=(
        "a prompt a decode worker caches all but at most this many tokens of is prefilled and "
        "decoded there, skipping the prefill worker (0: off)"))
    # The store master(s) whose WatchEvents feed the index ("" = workers' caches only).
    store_address: str = flag("", help=(
        "store master(s) whose events feed the KV index (default: none)"))
    kv_overlap_weight: float = 1.0  # KV-aware: weight of the prefill cost against queue load
    kv_fetch_weight: float = 0.2  # a block fetched from the store costs this x computing it
    kv_request_cost_tokens: float = 64.0  # queue load per request in flight, in prompt tokens
    routing_seed: int = 0  # power_of_two's random draws (reproducible)
    stats_interval_s: float = flag(1.0, help=(
        "seconds between polls of every worker's stats (health and load)"))
    max_missed_polls: int = flag(3, help=(
        "polls in a row a worker may miss before it leaves its pool (gone)"))
    # A prefill call with no answer within 4x its predicted compute (once the worker's rate is
    # measured), and at least this long, takes the worker out of its pool as if dead (its
    # polls bring it back after as long again) and is re-routed: a worker whose engine is
    # stuck may still answer its polls. 0: off.
    first_answer_min_s: float = flag(30.0, help=(
        "the least time a worker call may wait for its first answer before the worker counts "
        "as stalled (0: no deadline)"))
    # The OpenAI-compatible HTTP API (pdserve.router.openai_api): None turns it off, 0 picks a
    # free port (the ready line says which).
    http_host: str = flag("127.0.0.1", help="OpenAI-compatible HTTP API host")
    http_port: int | None = flag(None, help=(
        "OpenAI-compatible HTTP API port (0: a free port; default: no HTTP)"))
    http_max_body_bytes: int = 1 << 20  # larger request bodies get 413
    # HTTP connections held at once; past it a request gets 429 (None: derived, see below).
    http_max_connections: int | None = flag(None, help=(
        "HTTP connections held (default: max(8 x max-in-flight, 256); at least "
        "max-in-flight + 4)"))
    # Admission (pdserve.router.admission): requests held at once, overall and per tenant
    # (0: no per-tenant bound), and a per-tenant rate limit (0: none) with its burst.
    max_in_flight: int = flag(128, help=(
        "requests held at once; more get RESOURCE_EXHAUSTED / HTTP 429"))
    max_in_flight_per_tenant: int = 0
    tenant_rate_rps: float = flag(0.0, help="requests/s one tenant may start (0: no limit)")
    tenant_burst: int = 8
    # Refuse (RESOURCE_EXHAUSTED / 429) a request whose predicted time to first token is over
    # this (0: off). 10 s: on CPU the embedded default model (SmolLM2-135M) prefills about 950
    # tokens/s (docs/benchmarks.md), so 10 s is about 9,500 queued prompt tokens, a handful of
    # full-context prompts or a few dozen chat turns; a client kept waiting longer than that
    # for its first token has mostly given up, and refusing it early (with the drain time as
    # its retry hint) keeps the TTFT of the requests admitted.
    max_predicted_ttft_s: float = flag(10.0, help=(
        "refuse (RESOURCE_EXHAUSTED / 429, retry hint = the queue's drain time) a request "
        "whose predicted time to first token is over this (0: off)"))
    # The prediction is corrected by the factor measured from what admitted requests waited
    # (`ttft_calibration.py`); this switch keeps the raw model, for comparing the two.
    uncalibrated_ttft: bool = flag(False, switch=True, help=(
        "predict TTFT from the measured prefill rates alone, without the correction learned "
        "from what admitted requests waited"))
    # On SIGTERM/SIGINT: refuse new requests at once, let those in flight finish within this,
    # then stop (requests still running end with UNAVAILABLE "router shutting down").
    shutdown_grace_s: float = flag(30.0, help=(
        "on SIGTERM/SIGINT: refuse new requests, let those in flight finish within this many "
        "seconds, then stop"))
    # API keys (`KEY TENANT` lines); PDSERVE_API_KEYS adds more. None and no variable: no auth.
    api_keys_file: str | None = flag(None, help=(
        "file of 'KEY TENANT' lines; PDSERVE_API_KEYS=KEY:TENANT,... adds more"))
    # Text in a chat message that spells a control token (e.g. `<|im_start|>`) is encoded as that
    # token, not as text: lets a client write template turns of its own. Off by default.
    allow_special_tokens_in_messages: bool = flag(False, switch=True, help=(
        "text in chat messages that spells a control token (e.g. <|im_start|>) becomes that "
        "token (default: encoded as text)"))

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca: needs tls_cert and tls_key")
        for f in ("tls_cert", "tls_key", "tls_client_ca", "admin_keys_file"):
            path = getattr(self, f)
            if path and not os.path.isfile(path):
                raise ConfigError(f"{f}: no such file {path!r}")
        if ":" not in self.control_address:
            raise ConfigError(f"control_address: expected host:port, got "
                              f"{self.control_address!r}")
        for f in ("prefill_addresses", "decode_addresses"):
            bad = [a for a in getattr(self, f) if not a or ":" not in a]
            if bad:
                raise ConfigError(f"{f}: expected host:port, got {bad[0]!r}")
        both = set(self.prefill_addresses) & set(self.decode_addresses)
        if both:
            raise ConfigError(f"decode_addresses: {sorted(both)[0]} is also a prefill worker")
        if self.routing not in ROUTING_CHOICES:
            raise ConfigError(f"routing must be one of {ROUTING_CHOICES}, got {self.routing!r}")
        if self.decode_streams not in DECODE_STREAMS:
            raise ConfigError(f"decode_streams must be one of {DECODE_STREAMS}, "
                              f"got {self.decode_streams!r}")
        if self.decode_routing not in DECODE_POLICIES:
            raise ConfigError(f"decode_routing must be one of {DECODE_POLICIES}, "
                              f"got {self.decode_routing!r}")
        if self.block_size_tokens < 1:
            raise ConfigError(f"block_size_tokens must be >= 1, got {self.block_size_tokens}")
        if self.max_local_prefill_tokens < 0:
            raise ConfigError(f"max_local_prefill_tokens: must be >= 0 (0: off), got "
                              f"{self.max_local_prefill_tokens}")
        for f in ("kv_overlap_weight", "kv_fetch_weight", "kv_request_cost_tokens"):
            if getattr(self, f) < 0:
                raise ConfigError(f"{f} must be >= 0, got {getattr(self, f)}")
        # Membership needs the polls: without them a dead worker would never leave its pool.
        if self.stats_interval_s <= 0:
            raise ConfigError(f"stats_interval_s must be > 0, got {self.stats_interval_s}")
        if not 0 <= self.first_answer_min_s < float("inf"):
            raise ConfigError(f"first_answer_min_s must be >= 0, got {self.first_answer_min_s}")
        if self.max_missed_polls < 1:
            raise ConfigError(f"max_missed_polls must be >= 1, got {self.max_missed_polls}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ConfigError(f"http_port: must be in [0, 65535], got {self.http_port}")
        if self.max_in_flight < 1 or self.max_in_flight_per_tenant < 0:
            raise ConfigError("max_in_flight must be >= 1 and max_in_flight_per_tenant >= 0")
        if self.tenant_rate_rps < 0 or self.tenant_burst < 1:
            raise ConfigError("tenant_rate_rps must be >= 0 and tenant_burst >= 1")
        if self.http_max_body_bytes < 1024:
            raise ConfigError(f"http_max_body_bytes: must be >= 1024, got "
                              f"{self.http_max_body_bytes}")
        if not 0 <= self.max_predicted_ttft_s < float("inf"):
            raise ConfigError(f"max_predicted_ttft_s: must be >= 0 (0: off), got "
                              f"{self.max_predicted_ttft_s}")
        if not 0 <= self.shutdown_grace_s < float("inf"):
            raise ConfigError(f"shutdown_grace_s: must be >= 0, got {self.shutdown_grace_s}")
        self._derive_bounds()

    def _derive_bounds(self) -> None:
        """Fill in the bounds left None and check that admission refuses before any of them:
        rpc_threads >= max_in_flight + MIN_SPARE_THREADS, http_max_connections >= the same,
        and max_concurrent_rpcs >= rpc_threads + http_max_connections (gRPC clients get room
        for as many calls as HTTP has connections; HTTP requests run the same servicer in
        process, on a pool of rpc_threads threads of their own). Then every refusal under
        overload is admission's, with its retry hint; past the bounds, HTTP connections and
        gRPC calls are refused with a retry hint too (`http_server`, `rpc_bound`)."""
        n = self.max_in_flight
        burst = max(8 * n, MIN_BURST)
        if self.rpc_threads is None:
            object.__setattr__(self, "rpc_threads", n + RPC_SPARE_THREADS)
        if self.http_max_connections is None:
            object.__setattr__(self, "http_max_connections", burst)
        if self.max_concurrent_rpcs is None:
            object.__setattr__(self, "max_concurrent_rpcs",
                               self.rpc_threads + self.http_max_connections + burst)
        need = n + MIN_SPARE_THREADS
        if self.rpc_threads < need:
            raise ConfigError(
                f"rpc_threads: must be >= max_in_flight + {MIN_SPARE_THREADS} = {need}, got "
                f"{self.rpc_threads}: each admitted request holds a handler thread, and calls "
                "past the threads would wait where admission never sees them")
        if self.http_max_connections < need:
            raise ConfigError(
                f"http_max_connections: must be >= max_in_flight + {MIN_SPARE_THREADS} = "
                f"{need}, got {self.http_max_connections}: past it HTTP clients are refused "
                "before admission, which knows when to retry, can answer")
        floor = self.rpc_threads + self.http_max_connections
        if self.max_concurrent_rpcs < floor:
            raise ConfigError(
                f"max_concurrent_rpcs: must be >= rpc_threads + http_max_connections = {floor}, "
                f"got {self.max_concurrent_rpcs}: past it gRPC refuses calls itself, with no "
                "retry hint")

    def prefill_policy(self) -> str:
        if self.routing != "auto":
            return self.routing
        return "round_robin" if len(self.prefill_addresses) == 1 else "kv_aware"
