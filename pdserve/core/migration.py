"""Live migration's shared names and its one choice, defined once for the worker, the
controller and the simulator.

Owns why a running decode moves (`DRAIN`, `BALANCE`, `SHUTDOWN`: the worker's counters and the
`Migrate` call's reason), how its copy went (`COPIED`, `PARTIAL`), and which running decodes a
balance moves (`most_left`). Must not import torch, grpc or a service.
"""

from __future__ import annotations

DRAIN, BALANCE, SHUTDOWN = "drain", "balance", "shutdown"  # why a sequence moves
REASONS = (DRAIN, BALANCE, SHUTDOWN)
COPIED, PARTIAL = "copied", "partial"  # every full block in the store, or not


def most_left(left: dict[str, int], count: int) -> list[str]:
    """Of the requests and their tokens left to generate, the `count` with the most (ties by
    request id); all of them when fewer run."""
    return sorted(left, key=lambda rid: (-left[rid], rid))[:max(count, 0)]
