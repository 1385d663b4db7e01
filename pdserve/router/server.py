"""Builds the router process.

Owns the wiring: tokenizer and model config (no weights), the workers it routes to (membership,
both pools), the public gRPC server (Generation, ListModels, health that says SERVING exactly
while a request can be served: `membership.health_of`, and reflection of those alone), the
control listener beside it (RouterControl: TLS, every call authenticated by its `Guard`, a
cluster identity or an admin key; never on the public port), the OpenAI-compatible HTTP server
(when configured; its `/health` tells the same truth with the reason), the public ports' TLS
when given, all sized above admission's bound (`config.RouterConfig._derive_bounds`), and the
graceful shutdown:
on SIGTERM/SIGINT refuse new requests and say NOT_SERVING at once, let those in flight finish
within the grace, end the rest with UNAVAILABLE "router shutting down", stop, exit 0.
Must not hold request logic: `service.py`, `lifecycle.py`, `control.py` and `pool.py` do.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence

from pdserve import rpc
from pdserve.core.identity import ROUTER
from pdserve.security.keys import AdminKeys
from pdserve.engine.checkpoint_config import load_model_config
from pdserve.engine.model_files import recommended_sampling
from pdserve.engine.tokenizer import Tokenizer
from grpc_health.v1 import health_pb2

from pdserve.proto import api_pb2_grpc, router_pb2_grpc
from pdserve.metrics import CONTENT_TYPE_LATEST, RouterMetrics, render
from pdserve.router.admission import Admission, AdmissionConfig
from pdserve.security.tenants import ApiKeys, KeyFileError
from pdserve.router.config import RouterConfig
from pdserve.kvstore.members_client import MembersClient
from pdserve.router.cluster_feed import ClusterFeed
from pdserve.router.control import RequestSignals, RouterControlServicer
from pdserve.router.kv_feed import KvFeeds
from pdserve.router.lifecycle import shutdown_plan
from pdserve.router.limits import grpc_receive_bytes
from pdserve.router.policy import make_policy
from pdserve.router.pool import WorkerSet
from pdserve.router.service import RouterService

log = logging.getLogger(__name__)

# Services whose health follows membership: SERVING only while a request can be served.
_ROUTING_SERVICES = ("", "pdserve.v1.Generation")
# The control listener carries membership calls (a heartbeat per worker per few seconds) and
# the controller's polls: a few threads, and a bound past which gRPC refuses at once.
_CONTROL_THREADS = 8
_CONTROL_MAX_RPCS = 64


def served_names(cfg: RouterConfig) -> tuple[str, ...]:
    """Ids a client may send as `model`; the first is the one `/v1/models` lists: the configured
    name, else the file or folder name. The file or folder name is always accepted, and a
    `.gguf` file's name without its extension too."""
    base = os.path.basename(os.path.normpath(cfg.model_path))
    names = [cfg.model_name] if cfg.model_name else []
    names += [base, base.removesuffix(".gguf")]
    return tuple(dict.fromkeys(n for n in names if n))


def build_workers(cfg: RouterConfig, on_kv_lag=None) -> WorkerSet:
    """Both pools over one membership: the flags' workers are the first members. The prefill
    policy (with kv_aware, the block index fed by every member's and the store's event
    streams) and the decode policy (over polled worker stats). The index is also kept when
    decode workers may prefill prompts they cache (`max_local_prefill_tokens`)."""
    weights = dict(overlap_weight=cfg.kv_overlap_weight, fetch_weight=cfg.kv_fetch_weight,
                   request_cost_tokens=cfg.kv_request_cost_tokens)
    name = cfg.prefill_policy()
    feeds = (KvFeeds((), cfg.store_address, on_lag=on_kv_lag).start()
             if name == "kv_aware" or cfg.max_local_prefill_tokens > 0 else None)
    return WorkerSet(cfg.prefill_addresses, cfg.decode_addresses,
                     prefill_policy=make_policy(name, seed=cfg.routing_seed, **weights),
                     decode_policy=make_policy(cfg.decode_routing, seed=cfg.routing_seed + 1,
                                               **weights),
                     block_size_tokens=cfg.block_size_tokens, feeds=feeds,
                     stats_interval_s=cfg.stats_interval_s, max_missed=cfg.max_missed_polls,
                     first_answer_min_s=cfg.first_answer_min_s)


def build_service(cfg: RouterConfig) -> RouterService:
    model_config = load_model_config(cfg.model_path)
    tokenizer = Tokenizer.from_path(
        cfg.model_path, allow_special_tokens_in_messages=cfg.allow_special_tokens_in_messages)
    max_len = min(cfg.max_model_len_tokens or model_config.max_position_embeddings,
                  model_config.max_position_embeddings)
    api_keys = ApiKeys.load(cfg.api_keys_file)  # before any thread starts: it may refuse
    names = served_names(cfg)
    metrics = RouterMetrics(names[0])
    workers = build_workers(cfg, metrics.kv_event_lag.observe)
    admission = Admission(AdmissionConfig(
        max_in_flight=cfg.max_in_flight, max_in_flight_per_tenant=cfg.max_in_flight_per_tenant,
        tenant_rate_rps=cfg.tenant_rate_rps, tenant_burst=cfg.tenant_burst,
        max_predicted_ttft_s=cfg.max_predicted_ttft_s,
        **({"calibration": None} if cfg.uncalibrated_ttft else {})))
    return RouterService(tokenizer, model_config, names, max_len, workers,
                         cfg.request_timeout_s, admission=admission, api_keys=api_keys,
                         metrics=metrics, signals=RequestSignals(),
                         decode_streams=cfg.decode_streams,
                         max_local_prefill_tokens=cfg.max_local_prefill_tokens)


def loopback(address: str) -> str:
    """Where this process reaches its own server bound at `address` (wildcards -> loopback)."""
    host, _, port = address.rpartition(":")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host in ("[::]", "::"):
        host = "[::1]"
    return f"{host}:{port}"


def build_http(cfg: RouterConfig, service: RouterService, grpc_address: str,
               extra_routes: Sequence = ()):
    """The HTTP server (not started): an OpenAIApp calling this router's `Generate` in process
    (on a pool of `rpc_threads`, as gRPC calls are), its other gRPC services over loopback."""
    from starlette.responses import Response
    from starlette.routing import Route

    from pdserve.router.local_call import LocalGeneration
    from pdserve.router.http_server import HttpServer
    from pdserve.router.openai_api import OpenAIApp

    async def metrics(request):
        return Response(render(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    extra_routes = (Route("/metrics", metrics, methods=["GET"]), *extra_routes)
    defaults, source = recommended_sampling(cfg.model_path)
    if defaults:
        log.info("HTTP requests that leave them unset sample with %s (from %s)",
                 ", ".join(f"{k}={v}" for k, v in sorted(defaults.items())), source)
    app = OpenAIApp(loopback(grpc_address), service.model_names, service.max_model_len,
                    service.tokenizer, service.model_config.vocab_size,
                    max_body_bytes=cfg.http_max_body_bytes,
                    request_timeout_s=cfg.request_timeout_s, extra_routes=extra_routes,
                    health=service.door.health, api_keys=service.api_keys,
                    sampling_defaults=defaults,
                    generation=LocalGeneration(service.Generate, cfg.rpc_threads))
    # Bounded (invariant 5): a connection past this gets a 429 with Retry-After, counted as
    # a refusal; the config keeps it above max_in_flight, so admission answers first.
    return HttpServer(app.app, cfg.http_host, cfg.http_port or 0,
                      max_connections=cfg.http_max_connections, tls=public_tls(cfg),
                      on_refused=lambda: service.metrics.rejected("connections"),
                      share_port=cfg.share_port)


def public_tls(cfg: RouterConfig) -> rpc.PublicTls | None:
    if not cfg.tls_cert:
        return None
    return rpc.PublicTls(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)


def build_control(cfg: RouterConfig, service: RouterService, admin_keys: AdminKeys):
    """The control listener's server (not bound): RouterControl behind a control-plane Guard
    (a tenant's API key is told PERMISSION_DENIED), with health and reflection."""
    server = rpc.make_server(_CONTROL_THREADS, maximum_concurrent_rpcs=_CONTROL_MAX_RPCS)
    guard = rpc.Guard(ROUTER, rpc.CONTROL, admin_keys,
                      is_tenant_key=service.api_keys.holds)
    rpc.add_servicer(server, router_pb2_grpc.add_RouterControlServicer_to_server,
                     RouterControlServicer(service.workers, service.signals), guard)
    health = rpc.add_health_and_reflection(server, ["pdserve.v1.RouterControl"])
    return server, health


def follow_cluster(cfg: RouterConfig, service: RouterService, control_where: str,
                   clients: str) -> ClusterFeed | None:
    """Join the cluster's membership table on the store master and follow it (None: no
    master named, so membership is this router's own: its flags and RegisterWorker)."""
    if not cfg.store_address:
        return None
    return ClusterFeed(MembersClient(cfg.store_address), service.workers,
                       cfg.advertise_control_address or loopback(control_where),
                       clients.strip()).start()


def run(cfg: RouterConfig, extra_routes: Sequence = (), health_address: str | None = None
        ) -> int:
    """Serve gRPC (and HTTP when cfg.http_port is set) until SIGTERM/SIGINT; an exit code."""
    from pdserve.router.http_server import HttpStartError

    rpc.catch_stop_signals()
    try:
        service = build_service(cfg)
        admin_keys = AdminKeys.load(cfg.admin_keys_file)
    except (KeyFileError, ValueError, OSError) as e:  # a bad key file: which line, no serving
        print(f"pdserve.router: {e}", file=sys.stderr, flush=True)
        return 2
    server = rpc.make_server(cfg.rpc_threads, maximum_concurrent_rpcs=cfg.max_concurrent_rpcs,
                             max_receive_message_bytes=grpc_receive_bytes(cfg.http_max_body_bytes),
                             on_busy=lambda: service.metrics.rejected("calls"),
                             share_port=cfg.share_port)
    rpc.add_servicer(server, api_pb2_grpc.add_GenerationServicer_to_server, service, None)
    health = rpc.add_health_and_reflection(server, ["pdserve.v1.Generation"])
    # The plaintext probe port (`health_address`) serves this servicer: it also says whether
    # the control listener serves (a Kubernetes startup probe), without exposing that service.
    health.set("pdserve.v1.RouterControl", health_pb2.HealthCheckResponse.SERVING)
    control, control_health = build_control(cfg, service, admin_keys)

    def follow(serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in _ROUTING_SERVICES:
            health.set(name, status)

    service.workers.watch(follow)
    probe = None
    try:
        port = rpc.bind_public(server, cfg.address, public_tls(cfg))
        control_port = rpc.bind(control, cfg.control_address, ROUTER, rpc.CONTROL)
        if health_address:  # the public health (SERVING while a request can be served)
            probe = rpc.serve_health(health, health_address)[0]
    except RuntimeError as e:
        print(f"cannot bind {cfg.address} or {cfg.control_address}: {e}", file=sys.stderr,
              flush=True)
        service.workers.close()
        return 1
    server.start()
    where = f"{cfg.address.rsplit(':', 1)[0]}:{port}"
    control_where = f"{cfg.control_address.rsplit(':', 1)[0]}:{control_port}"
    http = None
    try:
        if cfg.http_port is not None:
            http = build_http(cfg, service, where, extra_routes)
            http.start()
    except HttpStartError as e:
        print(str(e), file=sys.stderr, flush=True)
        server.stop(grace=None)
        control.stop(grace=None)
        service.workers.close()
        return 1
    # The control listener answers last: its health is the launcher's and a startup probe's
    # sign that the router is up, so the HTTP front door listens by then.
    control.start()
    http_note = f" http={http.address}" if http is not None else ""
    feed = follow_cluster(cfg, service, control_where, f"{where}{http_note}")
    print(f"pdserve.router ready on {where} model={service.model_names[0]}{http_note} "
          f"control={control_where}", flush=True)
    signum = rpc.wait_for_signal()
    control_health.enter_graceful_shutdown()
    if feed is not None:
        feed.stop()
    shut_down(cfg, service, server, health, http, signum)
    control.stop(grace=1.0).wait()
    if probe is not None:
        probe.stop(grace=None)
    return 0


def shut_down(cfg: RouterConfig, service: RouterService, server, health, http,
              signum: int) -> None:
    """Stop admitting and say NOT_SERVING at once (a load balancer moves away), let requests
    in flight (gRPC, and HTTP through its in-process calls) finish within the grace, end the
    late ones with UNAVAILABLE "router shutting down", then stop both servers."""
    plan = shutdown_plan(time.monotonic(), cfg.shutdown_grace_s)
    door = service.door
    door.close()
    health.enter_graceful_shutdown()
    log.warning("signal %d: refusing new requests; %d in flight, given up to %gs", signum,
                door.in_flight, cfg.shutdown_grace_s)
    if not door.wait_idle(plan.requests_until_s):
        log.warning("%d requests still in flight at the deadline: ending them (%d worker calls "
                    "cancelled)", door.in_flight, door.expire())
        door.wait_idle(plan.stop_by_s)
    if http is not None:
        http.stop()
    server.stop(grace=max(0.0, plan.stop_by_s - time.monotonic())).wait()
    service.workers.close()
    log.info("stopped")
