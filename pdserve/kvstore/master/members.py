"""The cluster's membership table: which workers and routers belong to the cluster, as a pure core.

Owns one entry per member (a worker or a router): its kind, a worker's role and the state the
controller set (active, draining, failed) with the count of those moves (`state_seq`), when it
last joined, and the table's `version` (up by one on every change a follower must see) and
`epoch` (a new table: followers re-read it whole). Joins come from the members themselves
(their heartbeat), moves from the controller; members silent for `expire_after_s` leave.

Who decides what: a worker's heartbeat is the truth about the role it hosts, except just
after the controller moved it (a heartbeat sent before a switch may arrive after it), and the
controller alone sets draining and failed. Liveness for routing stays with each router (its own
polls): this table says who belongs and what the controller wants, not who answers now.

Pure: a `now` in, the updated table out; no I/O, no clock, no locks (the service holds one).
The table is soft state: after a master restart or failover the members' heartbeats rebuild it
within one heartbeat; a move the controller made is then lost, which is safe (a draining
worker refuses new requests itself, a failed one is re-admitted by the controller anyway).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.core.roles import ACTIVE, DRAINING, FAILED, ROLES

WORKER_KIND = "worker"
ROUTER_KIND = "router"
KINDS = (WORKER_KIND, ROUTER_KIND)
STATES = (ACTIVE, DRAINING, FAILED)
# Members silent for this many heartbeats leave the table.
EXPIRE_HEARTBEATS = 3
# The longest string field a member may send (an address, a reason).
MAX_FIELD = 512


class MemberError(ValueError):
    """A join or a move that cannot apply; the message starts with the offending field."""


class UnknownMember(MemberError):
    """A move of an address the table does not hold."""


@dataclass(frozen=True)
class Entry:
    address: str
    kind: str
    role: str = ""  # workers: prefill or decode
    state: str = ACTIVE  # workers: the controller's
    reason: str = "joined"
    state_seq: int = 0
    joined_s: float = 0.0  # when it last joined
    moved_s: float = float("-inf")  # when the controller last moved it
    client_address: str = ""  # routers: their client APIs, for operators


def _field(name: str, value: str) -> str:
    if len(value) > MAX_FIELD:
        raise MemberError(f"{name}: at most {MAX_FIELD} characters, got {len(value)}")
    return value


class Members:
    def __init__(self, epoch: str, heartbeat_s: float = 5.0, max_members: int = 100_000) -> None:
        if heartbeat_s <= 0:
            raise ValueError(f"heartbeat_s must be > 0, got {heartbeat_s}")
        self.epoch = epoch
        self.heartbeat_s = heartbeat_s
        self.expire_after_s = EXPIRE_HEARTBEATS * heartbeat_s
        self.max_members = max_members
        self.version = 0
        self._entries: dict[str, Entry] = {}

    def entries(self) -> list[Entry]:
        return sorted(self._entries.values(), key=lambda e: (e.kind, e.address))

    def get(self, address: str) -> Entry | None:
        return self._entries.get(address)

    def join(self, address: str, kind: str, role: str, now: float,
             client_address: str = "") -> Entry:
        """A member joins or joins again (its heartbeat). New members of kind worker join
        active in `role`; a worker that reports another role than the table's moves to it,
        unless the controller moved it within the last heartbeat."""
        if not address:
            raise MemberError("address: required")
        _field("address", address)
        _field("client_address", client_address)
        if kind not in KINDS:
            raise MemberError(f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
        if kind == WORKER_KIND and role not in ROLES:
            raise MemberError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
        if kind == ROUTER_KIND:
            role = ""
        old = self._entries.get(address)
        if old is None:
            if len(self._entries) >= self.max_members:
                raise MemberError(f"address: the table holds its limit of {self.max_members}")
            e = self._entries[address] = Entry(address, kind, role, joined_s=now,
                                               client_address=client_address)
            self.version += 1
            return e
        if old.kind != kind:
            raise MemberError(f"kind: {address} joined as a {old.kind}, not a {kind}")
        changed = old.client_address != client_address
        if role != old.role and now - old.moved_s > self.heartbeat_s:
            changed = True
        else:
            role = old.role
        e = self._entries[address] = replace(old, role=role, joined_s=now,
                                             client_address=client_address,
                                             reason="reported role" if role != old.role
                                             else old.reason)
        if changed:
            self.version += 1
        return e

    def set_state(self, address: str, state: str, role: str, reason: str, now: float) -> Entry:
        """The controller moves a worker: `state` in STATES; with ACTIVE, `role` ("" keeps it)."""
        old = self._entries.get(address)
        if old is None or old.kind != WORKER_KIND:
            raise UnknownMember(f"address: no worker {address} in the cluster")
        if state not in STATES:
            raise MemberError(f"state: must be one of {', '.join(STATES)}, got {state!r}")
        if role and role not in ROLES:
            raise MemberError(f"role: must be one of {', '.join(ROLES)}, got {role!r}")
        e = self._entries[address] = replace(
            old, state=state, role=role or old.role, reason=_field("reason", reason),
            state_seq=old.state_seq + 1, moved_s=now)
        self.version += 1
        return e

    def expire(self, now: float) -> list[str]:
        """Members silent past `expire_after_s` leave; their addresses."""
        gone = [a for a, e in self._entries.items() if now - e.joined_s > self.expire_after_s]
        for a in gone:
            del self._entries[a]
        if gone:
            self.version += 1
        return gone
