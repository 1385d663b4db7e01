"""`python -m pdserve.controller --router ADDR [--address ADDR] [--mode active|advisory|off]`."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import MISSING, fields

from pdserve import logctx
from pdserve.controller.config import ControllerConfig
from pdserve.engine.config import ConfigError
from pdserve.lifecycle import die_with_parent_if_asked


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    p = argparse.ArgumentParser(prog="python -m pdserve.controller")
    p.add_argument("--router", dest="router_address", required=True,
                   help="the router whose membership and budgets this controller steers")
    for f in fields(ControllerConfig):
        if f.name == "router_address":
            continue
        kind = {"int": int, "float": float, "bool": _flag}.get(f.type, str)
        default = None if f.default is MISSING else f.default
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default)
    args = p.parse_args(argv)
    logctx.configure(logging.INFO)
    try:
        cfg = ControllerConfig(**vars(args))
    except ConfigError as e:
        p.error(str(e))
    from pdserve.controller.server import run

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
