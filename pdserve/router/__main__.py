"""`python -m pdserve.router --model PATH [--prefill ADDR[,ADDR]] [--decode ADDR[,ADDR]]`.

Its flags are `RouterConfig`'s fields (`pdserve.flags`), and the internal-TLS ones."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import logctx
from pdserve.flags import add_config_flags, config_from_args
from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.core.errors import ConfigError
from pdserve.core.identity import ROUTER
from pdserve.security import cli as security_cli
from pdserve.router.config import RouterConfig


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    p = argparse.ArgumentParser(prog="python -m pdserve.router")
    add_config_flags(p, RouterConfig)
    security_cli.add_flags(p)
    a = p.parse_args(argv)
    logctx.configure(logging.INFO)
    security_cli.configure(a, ROUTER, p)
    try:
        cfg = config_from_args(RouterConfig, a)
    except ConfigError as e:
        p.error(str(e))
    from pdserve.router.server import run

    return run(cfg, health_address=a.health_address)


if __name__ == "__main__":
    sys.exit(main())
