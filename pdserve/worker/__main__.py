"""`python -m pdserve.worker --role prefill|decode --model PATH ...`: one worker process."""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from pdserve import logctx
from pdserve.lifecycle import die_with_parent_if_asked
from pdserve.engine.config import ConfigError
from pdserve.worker.config import WorkerConfig


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m pdserve.worker")
    parser.add_argument("--model", dest="model_path", required=True)
    for f in fields(WorkerConfig):
        if f.name == "model_path":
            continue
        kind = {"int": int, "bool": _flag}.get(f.type, str)
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
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
