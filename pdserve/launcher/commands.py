"""Every cluster process's command line from its config, and each process's config from a
`ClusterSpec`: what the local launcher and Ray's plan both start.

Owns one function for every process (`command`: the module its config's type runs as, the
flags of its config that differ from the config's defaults, `pdserve.flags.config_argv`, then
the internal-TLS flags it is given), its `pdserve <kind>` form (`as_cli`, as Ray's actors and
containers run them), and the configs a spec gives a worker, a router and a controller (the
launcher and the plan add only where each process lands: addresses, ports, folders). Must not
start anything or pick ports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.controller.config import ControllerConfig
from pdserve.flags import config_argv
from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.node.config import NodeConfig
from pdserve.launcher.cluster_spec import ClusterSpec
from pdserve.router.config import RouterConfig
from pdserve.worker.config import WorkerConfig

# The module each kind of process runs as (`python -m MODULE`), as `pdserve <kind>` runs it, by
# the config it runs with.
MODULES = {MasterConfig: "pdserve.kvstore.master", NodeConfig: "pdserve.kvstore.node",
           WorkerConfig: "pdserve.worker", RouterConfig: "pdserve.router",
           ControllerConfig: "pdserve.controller"}
_KINDS = {"pdserve.kvstore.master": "master", "pdserve.kvstore.node": "node",
          "pdserve.worker": "worker", "pdserve.router": "router",
          "pdserve.controller": "controller"}


def command(cfg: MasterConfig | NodeConfig | WorkerConfig | RouterConfig | ControllerConfig,
            security: Sequence[str] = ()) -> list[str]:
    """The process `cfg` configures: its module, the flags of `cfg` that differ from the
    defaults, then the internal-TLS flags given."""
    return [MODULES[type(cfg)], *config_argv(cfg), *security]


def as_cli(argv: Sequence[str]) -> list[str]:
    """A command's `pdserve <kind> ...` arguments (`pdserve.entrypoints`)."""
    return [_KINDS[argv[0]], *argv[1:]]


def worker_config(spec: ClusterSpec, role: str, address: str, store: str, metrics_port: int,
                  threads: int, **placed: Any) -> WorkerConfig:
    """A worker of the spec in `role`, serving `address`, joining the cluster's membership
    on the store master `store` (every router follows it; its heartbeat teaches a restarted
    master or router again); `placed`: what its host adds (its device, its core ledger; on
    Ray its advertised address and host id).
    Speculative decoding is the decode workers'."""
    s = spec
    spec_fields = (dict(spec_method=s.spec_method, draft_path=s.draft_path,
                        num_speculative_tokens=s.num_speculative_tokens,
                        spec_schedule=s.spec_schedule)
                   if s.spec_method and role == "decode" else {})
    return WorkerConfig(
        model_path=s.model_path, role=role, address=address, store_address=store,
        dtype=s.dtype, quantization=s.quantization, num_blocks=s.num_blocks,
        block_size_tokens=s.block_size_tokens, max_num_batched_tokens=s.max_num_batched_tokens,
        threads=threads, metrics_port=metrics_port,
        cluster_id=s.cluster_id, progressive_kv=s.progressive_kv, engine=s.engine,
        profile=s.profile, kv_scale=s.kv_scale, **spec_fields, **placed)


def router_base(spec: ClusterSpec, address: str, control: str, store: str, routing: str
                ) -> dict[str, Any]:
    """What every router over the spec's workers is told: the model, where it serves, the
    KV index's store and block size, and the longest request, a worker's whole pool (the
    router refuses longer ones up front, and chat's default max_tokens, the rest of the
    context, fits)."""
    return dict(model_path=spec.model_path, address=address, control_address=control,
                max_model_len_tokens=spec.num_blocks * spec.block_size_tokens,
                routing=routing, block_size_tokens=spec.block_size_tokens,
                store_address=store)


def router_config(spec: ClusterSpec, address: str, control: str, store: str,
                  http: str | None, **placed: Any) -> RouterConfig:
    """The spec's router: its client ports (`http` "host:port", None: no HTTP), admission
    and key settings where the spec sets them, then the spec's `router_settings` over all of
    it; `placed`: what its host adds (the first pools, the TLS files' paths there)."""
    s = spec
    chosen = {k: v for k, v in (("max_in_flight", s.max_in_flight),
                                ("api_keys_file", s.api_keys_file),
                                ("max_predicted_ttft_s", s.max_predicted_ttft_s),
                                ("max_local_prefill_tokens", s.max_local_prefill_tokens))
              if v is not None}
    tls = dict(tls_cert=s.tls_cert, tls_key=s.tls_key, tls_client_ca=s.tls_client_ca)
    if http is not None:
        host, _, port = http.rpartition(":")
        placed = dict(http_host=host, http_port=int(port), **placed)
    return RouterConfig(**{**router_base(s, address, control, store, s.routing), **tls,
                           **chosen, "shutdown_grace_s": s.shutdown_grace_s, **placed,
                           **s.router_settings})


def controller_config(spec: ClusterSpec, address: str, router_control: str, store: str,
                      audit_log: str, metrics_port: int, **placed: Any) -> ControllerConfig:
    """The spec's controller steering every router in the cluster's membership on the store
    master `store` (and the router at `router_control`, known before it joins), then the
    spec's `controller_settings` over it."""
    s = spec
    return ControllerConfig(**{
        "router_address": router_control, "store_address": store, "address": address,
        "mode": s.controller_mode,
        "ttft_slo_ms": s.ttft_slo_ms, "itl_slo_ms": s.itl_slo_ms, "audit_log": audit_log,
        "metrics_port": metrics_port, **placed, **s.controller_settings})
