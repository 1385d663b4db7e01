"""What every `pdserve bench` subcommand does with its result: files, JSON or a table."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable

from rich.console import Console


def emit(result: dict[str, Any], *, json_out: bool, out_dir: str | None,
         write_outputs: Callable[[dict[str, Any], str], list[str]],
         print_tables: Callable[[dict[str, Any], Console], None]) -> int:
    """Write the JSON/PNG files to `out_dir` if given; print one JSON document on stdout with
    `json_out`, else the tables and the paths written. Returns the exit code (0)."""
    written = write_outputs(result, out_dir) if out_dir else []
    if json_out:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
        return 0
    console = Console()
    print_tables(result, console)
    for path in written:
        console.print(f"wrote {path}")
    return 0


def write_json(result: dict[str, Any], out_dir: str, name: str) -> str:
    """`result` as `out_dir/name` (indented, one trailing newline; the folder made if
    missing); the path written."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    return path


def number_list(flag: str, kind: type = int, example: str = "1,8,32"
                ) -> Callable[[str], tuple[Any, ...]]:
    """An argparse type for a comma-separated list of numbers, naming `flag` when it is bad."""
    what = "integers" if kind is int else "numbers"

    def parse(text: str) -> tuple[Any, ...]:
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{flag} wants {what} like {example}, got {text!r}") from None
    return parse


def threads_problem(prog: str, threads: int | None) -> str | None:
    """The message for a bad `--threads` (None: fine; None itself means "leave as is")."""
    if threads is not None and threads <= 0:
        return f"{prog}: --threads must be positive, got {threads}"
    return None


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Torch's thread count set to `threads` (None: left as is) for the block, and given back
    after it, so in-process callers (tests) keep their setting."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)
