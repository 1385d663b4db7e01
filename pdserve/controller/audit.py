"""The controller's audit log: one JSON line per decision (its inputs and reason) and per flip.

Owns appending records and bounding the file: past `max_bytes` it is rotated to `<path>.1`
(one old file kept), so a controller that runs for months never fills a disk. Must not decide
anything or read clocks of its own: callers pass the record's time.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading


class AuditLog:
    def __init__(self, path: str, max_bytes: int = 64 << 20) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)

    def write(self, record: dict) -> None:
        if not self.path:
            return
        line = json.dumps(record, sort_keys=True, default=str) + "\n"
        with self._lock:
            with contextlib.suppress(FileNotFoundError):  # no file yet: nothing to rotate
                if os.path.getsize(self.path) + len(line) > self.max_bytes:
                    os.replace(self.path, self.path + ".1")
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)


def read_records(path: str) -> list[dict]:
    """Every record of an audit log (the rotated file first), for tests and tools."""
    out: list[dict] = []
    for p in (path + ".1", path):
        if os.path.exists(p):
            with open(p, encoding="utf-8") as f:
                out += [json.loads(line) for line in f if line.strip()]
    return out
