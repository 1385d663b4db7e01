"""The cluster membership service (pdserve.v1.ClusterMembers), hosted by the store master.

Owns the I/O around the pure `members.Members` table: a lock and a condition over it, the
clock, a fresh table (a new epoch) each time this master starts to lead, expiry of silent
members on the master's maintenance tick, and the long poll (`WatchMembers`) with a bound on
how many callers may wait at once (past it a caller gets the table at once, and polls).
Leadership and the cluster id are the master's (`MasterService.refuse_unless_leading`): a
standby refuses and names the leader. Must not decide what a join or a move means.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Callable

import grpc

from pdserve import rpc
from pdserve.kvstore.master.members import Entry, MemberError, Members, UnknownMember
from pdserve.kvstore.master.service import MasterService
from pdserve.proto import cluster_pb2 as cpb
from pdserve.proto import cluster_pb2_grpc as cpb_grpc

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
MAX_WAIT_S = 30.0
# Callers that may wait in WatchMembers at once (each holds one of the master's threads).
MAX_WATCHERS = 16


def entry_pb(e: Entry, now: float) -> cpb.ClusterMember:
    return cpb.ClusterMember(address=e.address, kind=e.kind, role=e.role, state=e.state,
                             reason=e.reason, state_seq=e.state_seq,
                             age_s=max(0.0, now - e.joined_s), client_address=e.client_address)


class MembersService(cpb_grpc.ClusterMembersServicer):
    def __init__(self, master: MasterService, heartbeat_s: float = HEARTBEAT_S,
                 clock: Callable[[], float] = time.monotonic,
                 max_watchers: int = MAX_WATCHERS) -> None:
        self.master = master
        self.heartbeat_s = heartbeat_s
        self.clock = clock
        self.max_watchers = max_watchers
        self._cond = threading.Condition()
        self._watchers = 0
        self._core = None  # the master core the table belongs to: a new one, a new table
        self._table = Members(uuid.uuid4().hex, heartbeat_s)

    def _members(self, context) -> Members:
        """The table of the leading master (caller holds the condition's lock)."""
        core = self.master.refuse_unless_leading(context)
        if core is not self._core:
            self._core = core
            self._table = Members(uuid.uuid4().hex, self.heartbeat_s)
            log.info("cluster membership: a new table (epoch %s)", self._table.epoch)
        return self._table

    def Join(self, request, context):
        with self._cond:
            table = self._members(context)
            before = table.version
            try:
                e = table.join(request.address, request.kind, request.role, self.clock(),
                               request.client_address)
            except MemberError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            if table.version != before:
                log.info("cluster membership: %s %s joins as %s", e.kind, e.address,
                         e.role or e.kind)
                self._cond.notify_all()
            return cpb.JoinResponse(version=table.version, heartbeat_s=self.heartbeat_s)

    def SetMemberState(self, request, context):
        with self._cond:
            table = self._members(context)
            try:
                e = table.set_state(request.address, request.state, request.role,
                                    request.reason, self.clock())
            except UnknownMember as err:
                context.abort(grpc.StatusCode.NOT_FOUND, str(err))
            except MemberError as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
            log.info("cluster membership: %s set to %s %s (%s) by %s", e.address, e.state,
                     e.role, e.reason or "no reason given", rpc.caller() or "an unknown caller")
            self._cond.notify_all()
            return entry_pb(e, self.clock())

    def WatchMembers(self, request, context):
        if not 0 <= request.wait_s <= MAX_WAIT_S:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"wait_s: must be within [0, {MAX_WAIT_S:g}], got {request.wait_s}")
        deadline = self.clock() + request.wait_s
        with self._cond:
            table = self._members(context)
            may_wait = self._watchers < self.max_watchers
            if may_wait:
                self._watchers += 1
            try:
                while (may_wait and table.epoch == request.epoch
                       and table.version <= request.after_version and context.is_active()):
                    left = deadline - self.clock()
                    if left <= 0:
                        break
                    self._cond.wait(min(left, 1.0))
                    table = self._members(context)
            finally:
                if may_wait:
                    self._watchers -= 1
            now = self.clock()
            return cpb.MembersView(epoch=table.epoch, version=table.version,
                                   members=[entry_pb(e, now) for e in table.entries()])

    def tick(self) -> None:
        """Members silent too long leave (the master's maintenance round calls this)."""
        with self._cond:
            if self.master.core is None or self.master.core is not self._core:
                return
            gone = self._table.expire(self.clock())
            if gone:
                log.info("cluster membership: %s left (silent)", ", ".join(gone))
                self._cond.notify_all()
