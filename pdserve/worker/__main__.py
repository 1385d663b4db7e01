"""`python -m pdserve.worker --role prefill|decode --model PATH ...`: one worker process."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import logctx
from pdserve.flags import add_config_flags, config_from_args
from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.core.errors import ConfigError
from pdserve.core.identity import WORKER
from pdserve.security import cli as security_cli
from pdserve.worker.config import WorkerConfig


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m pdserve.worker")
    add_config_flags(parser, WorkerConfig)
    security_cli.add_flags(parser)
    args = parser.parse_args(argv)
    logctx.configure(logging.INFO)
    security_cli.configure(args, WORKER, parser)
    try:
        cfg = config_from_args(WorkerConfig, args)
    except ConfigError as e:
        parser.error(str(e))
    from pdserve.worker.server import run  # heavy imports (torch) after argument errors

    return run(cfg, health_address=args.health_address)


if __name__ == "__main__":
    sys.exit(main())
