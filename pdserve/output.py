"""What a command does with its result document: files, one JSON document, or tables.

Owns `emit` (the JSON/PNG files into a folder, then JSON on stdout or the tables and the paths
written) and `write_json`, which every `pdserve bench` and `pdserve sim` command shares. Must
not know what a result holds: each command passes its own writers and tables.
"""

from __future__ import annotations

import json
import os
import sys
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


def write_report(result: dict[str, Any], out_dir: str, name: str,
                 plot: Callable[[dict[str, Any], str], None],
                 markdown: Callable[[dict[str, Any]], str]) -> list[str]:
    """`name`.json, `name`.png (drawn by `plot`) and `name`.md (`markdown`'s table) in
    `out_dir`; the paths written."""
    j = write_json(result, out_dir, f"{name}.json")
    png = os.path.join(out_dir, f"{name}.png")
    plot(result, png)
    md = os.path.join(out_dir, f"{name}.md")
    with open(md, "w") as f:
        f.write(markdown(result) + "\n")
    return [j, png, md]
