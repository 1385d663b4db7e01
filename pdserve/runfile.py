"""Where `pdserve serve` tells this user's other commands about the cluster it runs.

Owns one small JSON file per user (`$PDSERVE_STATE_DIR/current.json`, else
`$XDG_STATE_HOME/pdserve/current.json`, else `~/.local/state/pdserve/current.json`; folder
0700, file 0600): the controller's address, the router's control and client addresses, and the
cluster's TLS folder, so `pdserve ctl status` on the same machine needs no flags. Written once
the cluster is up, removed when it stops (only if it is still this cluster's). Holds paths and
addresses, never a key. Must not start or stop anything.

A module of its own at the bottom of the package, not in the launcher: `pdserve serve` writes
it and `pdserve ctl` (the controller's CLI, below the launcher) reads it.
"""

from __future__ import annotations

import contextlib
import json
import os

from pdserve.security.pki import write_atomic


def path() -> str:
    base = os.environ.get("PDSERVE_STATE_DIR") or os.path.join(
        os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state"), "pdserve")
    return os.path.join(base, "current.json")


def write(record: dict) -> str:
    p = path()
    os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)
    write_atomic(p, json.dumps(record, indent=2, sort_keys=True).encode(), 0o600)
    return p


def read() -> dict:
    """The record of the cluster `pdserve serve` runs now ({} when none or unreadable)."""
    try:
        with open(path(), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def remove(cluster_id: str) -> None:
    if read().get("cluster_id") == cluster_id:
        with contextlib.suppress(OSError):
            os.unlink(path())
