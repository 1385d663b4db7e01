"""A router following the cluster's membership table, and joining it.

Owns `changes()`, the pure rule that turns the table (pdserve.v1.ClusterMembers, on the store
master) into moves of this router's own membership: a worker it does not know joins in the
table's role; a move of the controller's it has not applied (a new `state_seq`) is applied;
nothing else (liveness stays with this router's own polls, and a worker missing from the table
is left to them: a master that restarted rebuilds the table from heartbeats). And
`ClusterFeed`, the thread that joins the table as a router (its control address, so the
controller finds every router) every heartbeat, and long-polls the table between heartbeats,
applying each new version through `WorkerSet`. A new epoch (a restarted master) forgets which
moves were applied. Must not decide a member's state: `membership.py` does, as for any move.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from pdserve.core.errors import UnknownMemberError
from pdserve.core.roles import ACTIVE
from pdserve.kvstore.master.members import ROUTER_KIND, WORKER_KIND
from pdserve.kvstore.members_client import MembersClient

log = logging.getLogger(__name__)

# The longest long poll: a change reaches the router at once; the wait only bounds how often
# an idle router asks.
WATCH_WAIT_S = 10.0
_RETRY_S = 1.0


@dataclass(frozen=True)
class Change:
    address: str
    join: bool  # True: join in `role`; False: the controller's move to `state`
    role: str
    state: str = ACTIVE
    reason: str = ""


def changes(entries: Iterable, known: set[str], applied: dict[str, int]) -> list[Change]:
    """What this router must do to follow `entries` (ClusterMember-like): joins of workers it
    does not know (`known`), and the controller's moves whose `state_seq` is not the one in
    `applied` (address -> the last applied). Pure."""
    out: list[Change] = []
    for e in entries:
        if e.kind != WORKER_KIND or not e.role:
            continue
        if e.address not in known:
            out.append(Change(e.address, True, e.role))
        if e.state_seq and applied.get(e.address) != e.state_seq:
            out.append(Change(e.address, False, e.role, e.state, e.reason))
    return out


class ClusterFeed:
    def __init__(self, client: MembersClient, workers, control_address: str,
                 client_address: str = "", heartbeat_s: float = 5.0,
                 wait_s: float = WATCH_WAIT_S) -> None:
        self.client = client
        self.workers = workers
        self.control_address = control_address
        self.client_address = client_address
        self.heartbeat_s = heartbeat_s
        self.wait_s = wait_s
        self.epoch = ""
        self.version = 0
        self.applied: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-feed", daemon=True)

    def start(self) -> "ClusterFeed":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.wait_s + 5.0)
        self.client.close()

    def apply(self, view) -> None:
        if view.epoch != self.epoch:
            self.epoch, self.applied = view.epoch, {}
        self.version = view.version
        known = {m.address for m in self.workers.members()}
        for c in changes(view.members, known, self.applied):
            try:
                if c.join:
                    self.workers.join(c.address, c.role)
                    log.info("cluster: %s joins as %s", c.address, c.role)
                else:
                    self.workers.set_state(c.address, c.state,
                                           c.role if c.state == ACTIVE else None, c.reason)
                    log.info("cluster: %s set to %s (%s)", c.address, c.state, c.reason)
            except (UnknownMemberError, ValueError) as err:
                log.warning("cluster: %s: %s", c.address, err)
        for e in view.members:
            if e.kind == WORKER_KIND:
                self.applied[e.address] = e.state_seq

    def _run(self) -> None:
        next_join = 0.0
        ok: bool | None = None  # logged on a change only
        while not self._stop.is_set():
            try:
                now = time.monotonic()
                if now >= next_join:
                    self.client.join(self.control_address, ROUTER_KIND,
                                     client_address=self.client_address)
                    next_join = now + self.heartbeat_s
                wait = max(0.0, min(self.wait_s, next_join - time.monotonic()))
                self.apply(self.client.watch(self.version, self.epoch, wait))
                if ok is not True:
                    log.info("following the cluster's membership (epoch %s)", self.epoch)
                ok = True
            except grpc.RpcError as e:
                if ok is not False:
                    log.warning("cluster membership unreachable (%s); retrying", e.code().name)
                ok = False
                next_join = 0.0
                self._stop.wait(_RETRY_S)
