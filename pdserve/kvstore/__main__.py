"""Command line of one store process: `python -m pdserve.kvstore --address HOST:PORT`.

Owns argument parsing and the ready line only; everything else is in `config` and `service`.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.core.errors import ConfigError
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.service import ServeError, serve
from pdserve.core.identity import MASTER
from pdserve.security import cli as security_cli


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    defaults = StoreConfig()
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.kvstore", description="Run one in-memory KV-cache store process."
    )
    parser.add_argument(
        "--address", default=defaults.address, help="host:port to listen on (port 0: any free port)"
    )
    parser.add_argument(
        "--capacity-bytes", type=int, default=defaults.capacity_bytes,
        help="most bytes of object data held before LRU eviction",
    )
    parser.add_argument(
        "--max-workers", type=int, default=defaults.max_workers, help="gRPC handler threads"
    )
    parser.add_argument(
        "--shutdown-grace-s", type=float, default=defaults.shutdown_grace_s,
        help="seconds in-flight RPCs may still run after SIGTERM",
    )
    security_cli.add_flags(parser, health=False)
    args = parser.parse_args(argv)
    security_cli.configure(args, MASTER, parser)
    try:
        config = StoreConfig(
            address=args.address,
            capacity_bytes=args.capacity_bytes,
            max_workers=args.max_workers,
            shutdown_grace_s=args.shutdown_grace_s,
        )
    except ConfigError as e:
        parser.error(str(e))

    def announce(address: str) -> None:
        # One line on stdout so scripts (and people) know when to connect.
        print(f"pdserve.kvstore ready on {address} ({config.capacity_bytes} bytes)", flush=True)

    try:
        serve(config, on_ready=announce)
    except ServeError as e:
        print(f"pdserve.kvstore: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
