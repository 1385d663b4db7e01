"""Command line of one store process: `python -m pdserve.kvstore --address HOST:PORT`.

Owns argument parsing (`StoreConfig`'s fields as flags, `pdserve.flags`) and the ready line
only; everything else is in `config` and `service`.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.flags import add_config_flags, config_from_args
from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.core.errors import ConfigError
from pdserve.kvstore.config import StoreConfig
from pdserve.kvstore.service import ServeError, serve
from pdserve.core.identity import MASTER
from pdserve.security import cli as security_cli


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.kvstore", description="Run one in-memory KV-cache store process."
    )
    add_config_flags(parser, StoreConfig)
    security_cli.add_flags(parser, health=False)
    args = parser.parse_args(argv)
    security_cli.configure(args, MASTER, parser)
    try:
        config = config_from_args(StoreConfig, args)
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
