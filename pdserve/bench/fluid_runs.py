"""The measured runs of `pdserve bench fluid` kept in `--out DIR`, so a run stopped part way
continues from the configurations already measured.

Owns the run files (`DIR/fluid-runs/<config>.run<k>.json`, each written whole or not at all)
and the key that says whether a file belongs to this run: a hash of every setting that shapes
the measurement (the model, the SLOs, the cluster, the controller's settings) and of the
workload's requests. A file with another key is measured again, never mixed in. Must not
measure or summarise anything.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

# Settings that choose which runs to make, not how one is measured.
_NOT_KEYED = ("configs", "runs", "logs_dir", "engine_checks")
# Settings of an emulated cluster: a cluster of real engines is keyed without them.
_EMULATION = ("emulated", "profile", "slowdown", "kv_scale", "workers")


def run_key(settings: dict[str, Any], model: str, requests) -> str:
    """The key of a measurement: its settings (less `_NOT_KEYED`), the model and the requests."""
    h = hashlib.sha256()
    skip = _NOT_KEYED + (() if settings.get("emulated") else _EMULATION)
    keyed = {k: v for k, v in settings.items() if k not in skip}
    h.update(json.dumps({"settings": keyed, "model": model}, sort_keys=True,
                        default=str).encode())
    for r in requests:
        h.update(repr((r.phase, round(r.arrival_s, 6), r.prompt, r.max_tokens)).encode())
    return h.hexdigest()[:24]


class RunFiles:
    """The run files of one key in `folder` (None: nothing kept, nothing resumed)."""

    def __init__(self, folder: str | None, key: str) -> None:
        self.folder, self.key = folder, key

    def _path(self, name: str, k: int) -> str:
        assert self.folder is not None
        return os.path.join(self.folder, f"{name.replace(':', '-')}.run{k + 1}.json")

    def load(self, name: str, k: int) -> dict[str, Any] | None:
        """The record of `name`'s run `k` measured earlier with this key, else None."""
        if self.folder is None:
            return None
        try:
            with open(self._path(name, k), encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):  # none yet, or cut short: measure it again
            return None
        ok = isinstance(doc, dict) and doc.get("key") == self.key and doc.get("name") == name
        return doc.get("record") if ok else None

    def save(self, name: str, k: int, record: dict[str, Any]) -> None:
        if self.folder is None:
            return
        os.makedirs(self.folder, exist_ok=True)
        path = self._path(name, k)
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump({"key": self.key, "name": name, "run": k + 1, "record": record}, f)
        os.replace(path + ".tmp", path)  # a stop mid-write leaves the old file or none
