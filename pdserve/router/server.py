"""Builds the router process: tokenizer and model config (no weights), worker pools, gRPC server."""

from __future__ import annotations

import os

from pdserve import rpc
from pdserve.engine.loader import load_model_config
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import api_pb2_grpc
from pdserve.router.config import RouterConfig
from pdserve.router.service import RouterService


def served_names(cfg: RouterConfig) -> tuple[str, ...]:
    """Ids a client may send as `model`: the configured name, the file or folder name, and its stem."""
    base = os.path.basename(os.path.normpath(cfg.model_path))
    names = [cfg.model_name] if cfg.model_name else []
    names += [base, os.path.splitext(base)[0]]
    return tuple(dict.fromkeys(n for n in names if n))


def build_service(cfg: RouterConfig) -> RouterService:
    model_config = load_model_config(cfg.model_path)
    tokenizer = Tokenizer.from_path(cfg.model_path)
    max_len = min(cfg.max_model_len_tokens or model_config.max_position_embeddings,
                  model_config.max_position_embeddings)
    prefill, decode = RouterService.default_pools(cfg.prefill_addresses, cfg.decode_addresses)
    return RouterService(tokenizer, model_config, served_names(cfg), max_len, prefill, decode,
                         cfg.request_timeout_s)


def run(cfg: RouterConfig) -> int:
    rpc.catch_stop_signals()
    service = build_service(cfg)
    server = rpc.make_server(cfg.rpc_threads, maximum_concurrent_rpcs=cfg.max_concurrent_rpcs)
    api_pb2_grpc.add_GenerationServicer_to_server(service, server)
    health = rpc.add_health_and_reflection(server, ["pdserve.v1.Generation"])
    code = rpc.run_until_signal(
        server, health, cfg.address,
        lambda where: f"pdserve.router ready on {where} model={service.model_names[0]}")
    service.prefill.close()
    service.decode.close()
    return code
