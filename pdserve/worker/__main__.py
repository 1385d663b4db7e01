"""`python -m pdserve.worker --role prefill|decode --model PATH ...`: one worker process."""

from __future__ import annotations

import argparse
import logging
import sys

from pdserve import logctx
from pdserve.flags import add_config_flags
from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.core.errors import ConfigError
from pdserve.worker.config import WorkerConfig


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m pdserve.worker")
    parser.add_argument("--model", dest="model_path", required=True)
    add_config_flags(parser, WorkerConfig, skip=("model_path",))
    args = parser.parse_args(argv)
    logctx.configure(logging.INFO)
    try:
        cfg = WorkerConfig(**vars(args))
    except ConfigError as e:
        parser.error(str(e))
    from pdserve.worker.server import run  # heavy imports (torch) after argument errors

    return run(cfg)


if __name__ == "__main__":
    sys.exit(main())
