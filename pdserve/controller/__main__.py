"""`python -m pdserve.controller --router ADDR [--address ADDR] [--mode active|advisory|off]`."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import logctx
from pdserve.flags import add_config_flags, config_from_args
from pdserve.controller.config import ControllerConfig
from pdserve.core.errors import ConfigError
from pdserve.core.identity import CONTROLLER
from pdserve.security import cli as security_cli
from pdserve.lifecycle import die_with_parent_if_asked


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    p = argparse.ArgumentParser(prog="python -m pdserve.controller")
    add_config_flags(p, ControllerConfig)
    security_cli.add_flags(p)
    args = p.parse_args(argv)
    logctx.configure(logging.INFO)
    security_cli.configure(args, CONTROLLER, p)
    try:
        cfg = config_from_args(ControllerConfig, args)
    except ConfigError as e:
        p.error(str(e))
    from pdserve.controller.server import run

    return run(cfg, health_address=args.health_address)


if __name__ == "__main__":
    sys.exit(main())
