"""`python -m pdserve.router --model PATH [--prefill ADDR[,ADDR]] [--decode ADDR[,ADDR]]`."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import logctx
from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.core.errors import ConfigError
from pdserve.core.identity import ROUTER
from pdserve.security import cli as security_cli
from pdserve.router.config import DECODE_STREAMS, ROUTING_CHOICES, RouterConfig
from pdserve.router.policy import DECODE_POLICIES


def _addresses(text: str) -> tuple[str, ...]:
    return tuple(a.strip() for a in text.split(",") if a.strip())


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    p = argparse.ArgumentParser(prog="python -m pdserve.router")
    p.add_argument("--model", required=True, help="model path (GGUF file or HF folder)")
    p.add_argument("--prefill", default="",
                   help="comma-separated prefill workers to start with (more may register)")
    p.add_argument("--decode", default="",
                   help="comma-separated decode workers to start with (more may register)")
    p.add_argument("--address", default="127.0.0.1:50051", help="the client APIs (gRPC)")
    p.add_argument("--control-address", default="127.0.0.1:0",
                   help="the control API for workers, the controller and operators (TLS, each "
                        "call authenticated; port 0: a free one, printed as control=)")
    p.add_argument("--admin-keys-file", default=None,
                   help="file of 'KEY [NAME]' lines: keys that may use the control API")
    p.add_argument("--tls-cert", default="", help="TLS certificate of the client APIs")
    p.add_argument("--tls-key", default="", help="its private key")
    p.add_argument("--tls-client-ca", default="",
                   help="require client certificates from this CA on the client APIs")
    p.add_argument("--model-name", default=None)
    p.add_argument("--max-model-len-tokens", type=int, default=None)
    p.add_argument("--rpc-threads", type=int, default=None,
                   help="gRPC handler threads (default: max-in-flight + 32; at least "
                        "max-in-flight + 4)")
    p.add_argument("--max-concurrent-rpcs", type=int, default=None,
                   help="gRPC calls running or queued before gRPC itself refuses (default: "
                        "derived; at least rpc-threads + http-max-connections)")
    p.add_argument("--http-host", default="127.0.0.1", help="OpenAI-compatible HTTP API host")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP API port (0: a free port; default: no HTTP)")
    p.add_argument("--http-max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--http-max-connections", type=int, default=None,
                   help="HTTP connections held (default: max(8 x max-in-flight, 256); at "
                        "least max-in-flight + 4)")
    p.add_argument("--routing", default="auto", choices=ROUTING_CHOICES,
                   help="prefill routing policy (auto: kv_aware with 2+ prefill workers)")
    p.add_argument("--decode-routing", default="free_kv", choices=DECODE_POLICIES)
    p.add_argument("--decode-streams", default="shared", choices=DECODE_STREAMS,
                   help="shared: one stream per decode worker for all requests (a step's tokens "
                        "in one message); per_request: a Decode call per request")
    p.add_argument("--block-size-tokens", type=int, default=16,
                   help="the workers' KV block size (prompts are hashed with it)")
    p.add_argument("--store-address", default="",
                   help="store master(s) whose events feed the KV index (default: none)")
    p.add_argument("--kv-overlap-weight", type=float, default=1.0)
    p.add_argument("--kv-fetch-weight", type=float, default=0.2)
    p.add_argument("--kv-request-cost-tokens", type=float, default=64.0)
    p.add_argument("--routing-seed", type=int, default=0)
    p.add_argument("--stats-interval-s", type=float, default=1.0,
                   help="seconds between polls of every worker's stats (health and load)")
    p.add_argument("--max-missed-polls", type=int, default=3,
                   help="polls in a row a worker may miss before it leaves its pool (gone)")
    p.add_argument("--max-in-flight", type=int, default=128,
                   help="requests held at once; more get RESOURCE_EXHAUSTED / HTTP 429")
    p.add_argument("--max-in-flight-per-tenant", type=int, default=0)
    p.add_argument("--tenant-rate-rps", type=float, default=0.0,
                   help="requests/s one tenant may start (0: no limit)")
    p.add_argument("--tenant-burst", type=int, default=8)
    p.add_argument("--max-predicted-ttft-s", type=float, default=10.0,
                   help="refuse (RESOURCE_EXHAUSTED / 429, retry hint = the queue's drain time) "
                        "a request whose predicted time to first token is over this (0: off)")
    p.add_argument("--max-local-prefill-tokens", type=int, default=64,
                   help="a prompt a decode worker caches all but at most this many tokens of "
                        "is prefilled and decoded there, skipping the prefill worker (0: off)")
    p.add_argument("--shutdown-grace-s", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: refuse new requests, let those in flight finish "
                        "within this many seconds, then stop")
    p.add_argument("--api-keys-file", default=None,
                   help="file of 'KEY TENANT' lines; PDSERVE_API_KEYS=KEY:TENANT,... adds more")
    p.add_argument("--allow-special-tokens-in-messages", action="store_true",
                   help="text in chat messages that spells a control token (e.g. <|im_start|>) "
                        "becomes that token (default: encoded as text)")
    security_cli.add_flags(p)
    a = p.parse_args(argv)
    logctx.configure(logging.INFO)
    security_cli.configure(a, ROUTER, p)
    try:
        cfg = RouterConfig(model_path=a.model, prefill_addresses=_addresses(a.prefill),
                           decode_addresses=_addresses(a.decode), address=a.address,
                           control_address=a.control_address, admin_keys_file=a.admin_keys_file,
                           tls_cert=a.tls_cert, tls_key=a.tls_key, tls_client_ca=a.tls_client_ca,
                           model_name=a.model_name, max_model_len_tokens=a.max_model_len_tokens,
                           rpc_threads=a.rpc_threads, max_concurrent_rpcs=a.max_concurrent_rpcs,
                           http_host=a.http_host, http_port=a.http_port,
                           http_max_body_bytes=a.http_max_body_bytes,
                           http_max_connections=a.http_max_connections, routing=a.routing,
                           decode_routing=a.decode_routing, decode_streams=a.decode_streams,
                           block_size_tokens=a.block_size_tokens,
                           store_address=a.store_address, kv_overlap_weight=a.kv_overlap_weight,
                           kv_fetch_weight=a.kv_fetch_weight,
                           kv_request_cost_tokens=a.kv_request_cost_tokens,
                           routing_seed=a.routing_seed, stats_interval_s=a.stats_interval_s,
                           max_missed_polls=a.max_missed_polls, max_in_flight=a.max_in_flight,
                           max_in_flight_per_tenant=a.max_in_flight_per_tenant,
                           tenant_rate_rps=a.tenant_rate_rps, tenant_burst=a.tenant_burst,
                           api_keys_file=a.api_keys_file,
                           max_predicted_ttft_s=a.max_predicted_ttft_s,
                           max_local_prefill_tokens=a.max_local_prefill_tokens,
                           shutdown_grace_s=a.shutdown_grace_s,
                           allow_special_tokens_in_messages=a.allow_special_tokens_in_messages)
    except ConfigError as e:
        p.error(str(e))
    from pdserve.router.server import run

    return run(cfg, health_address=a.health_address)


if __name__ == "__main__":
    sys.exit(main())
