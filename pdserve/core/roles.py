"""Roles and states: the names every part of the cluster uses for what a worker does and how
it stands.

Owns the two roles (`PREFILL`, `DECODE`); a member's state in a router's membership table
(`ACTIVE` in its role's pool, `DRAINING`, `GONE`: missed its polls, `FAILED`: a flip failed);
and a worker's state as the controller and the simulator see it (`SERVING`, `DRAINING`,
`SWITCHING` roles, `FAILED`, `GONE`; the simulator's `STARTING` before it serves). They are
plain strings, so they compare equal to what the wire mapping, the metrics' labels and the
configuration files spell. Must not import torch or any service.
"""

from __future__ import annotations

from typing import Final

PREFILL: Final = "prefill"
DECODE: Final = "decode"
ROLES: Final = (PREFILL, DECODE)

# A member of a router's membership table (router/membership.py moves them).
ACTIVE: Final = "active"
DRAINING: Final = "draining"
GONE: Final = "gone"
FAILED: Final = "failed"
MEMBER_STATES: Final = (ACTIVE, DRAINING, GONE, FAILED)

# A worker as the controller (controller/policy.py) and the simulator (sim/worker.py) see it.
STARTING: Final = "starting"  # the simulator's: loading, not yet serving
SERVING: Final = "serving"
SWITCHING: Final = "switching"
WORKER_STATES: Final = (SERVING, DRAINING, SWITCHING, FAILED, GONE)
