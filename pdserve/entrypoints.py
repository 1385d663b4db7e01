"""One `pdserve` subcommand per process of a cluster: `pdserve master|node|worker|router|
controller [flags]`, so a container, a Ray actor and the local launcher start them the same way.

Owns the mapping of a process kind to its module's `main(argv)` and the environment form of its
flags: `PDSERVE_<KIND>_<FLAG>` (e.g. `PDSERVE_ROUTER_MAX_IN_FLIGHT=64` for `--max-in-flight 64`)
is read before the command line, so a flag given on the command line wins. Every process reports
ready through its gRPC health service. Must not parse any process's flags itself: an unknown
flag is refused by that process's parser, which names it.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping

PROCESSES: dict[str, tuple[str, str]] = {
    "master": ("pdserve.kvstore.master.__main__", "the KV store master (metadata, leases)"),
    "node": ("pdserve.kvstore.node.__main__", "a KV store storage node (memory/SSD tiers)"),
    "worker": ("pdserve.worker.__main__", "a worker: loads the model once, prefill or decode"),
    "router": ("pdserve.router.__main__", "the router: gRPC and OpenAI HTTP front door"),
    "controller": ("pdserve.controller.__main__", "the controller: roles and prefill offload"),
}


def env_flags(kind: str, environ: Mapping[str, str]) -> list[str]:
    """Flags from `PDSERVE_<KIND>_<FLAG>` variables, sorted by name (an empty value passes the
    flag with an empty value)."""
    prefix = f"PDSERVE_{kind.upper()}_"
    out: list[str] = []
    for name in sorted(environ):
        if name.startswith(prefix) and len(name) > len(prefix):
            out += ["--" + name[len(prefix):].lower().replace("_", "-"), environ[name]]
    return out


def run(kind: str, argv: list[str]) -> int:
    """Run process `kind` with its environment flags, then `argv`; its exit code."""
    module = importlib.import_module(PROCESSES[kind][0])
    return module.main(env_flags(kind, os.environ) + list(argv))
