"""What the `pdserve bench` subcommands share: their flags' number lists and thread counts.

Their result documents go out through `pdserve.output`.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable


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
