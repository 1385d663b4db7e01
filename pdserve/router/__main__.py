"""`python -m pdserve.router --model PATH --prefill ADDR[,ADDR] --decode ADDR[,ADDR]`."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.engine.config import ConfigError
from pdserve.router.config import RouterConfig


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    p = argparse.ArgumentParser(prog="python -m pdserve.router")
    p.add_argument("--model", required=True, help="model path (GGUF file or HF folder)")
    p.add_argument("--prefill", required=True, help="comma-separated prefill worker addresses")
    p.add_argument("--decode", required=True, help="comma-separated decode worker addresses")
    p.add_argument("--address", default="127.0.0.1:50051")
    p.add_argument("--model-name", default=None)
    p.add_argument("--max-model-len-tokens", type=int, default=None)
    p.add_argument("--rpc-threads", type=int, default=64)
    p.add_argument("--max-concurrent-rpcs", type=int, default=256)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = RouterConfig(model_path=a.model, prefill_addresses=tuple(a.prefill.split(",")),
                           decode_addresses=tuple(a.decode.split(",")), address=a.address,
                           model_name=a.model_name, max_model_len_tokens=a.max_model_len_tokens,
                           rpc_threads=a.rpc_threads, max_concurrent_rpcs=a.max_concurrent_rpcs)
    except ConfigError as e:
        p.error(str(e))
    from pdserve.router.server import run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
