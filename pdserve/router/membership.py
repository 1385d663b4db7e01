"""Who serves which role now: the router's membership table, as a pure core.

Owns each known worker's role and state (ACTIVE in a role's pool, DRAINING, GONE, FAILED), the
router's own load on it (requests and predicted prefill tokens in flight, prompt tokens of
offloaded requests in flight and the controller's offload budget with its chunk and step time),
its last reported stats, and the transitions between states: joins, successful polls
(`report`), missed polls (`missed`), a call with no first answer in time (`stalled`), the
controller's moves (`set_state`) and forgetting long-gone workers (`forget_gone`); and whether a
request can be served at all (`health_of`: the router's health).

Pure: inputs and a `now` in, the updated `Member` out; no I/O, no clock reads, no threads, no
locks (the adapter in `pool.py` holds one around every call). Must not import torch, grpc or
the engine: the simulator drives it unchanged.

Who moves what: polls move ACTIVE <-> GONE and follow a role a worker reports (someone switched
it by hand); only the controller moves a worker into or out of DRAINING and FAILED, because it
alone knows why (a role flip in progress, a flip that failed).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.core.errors import UnknownMemberError  # noqa: F401 - raised here, re-exported
# The table's own vocabulary, re-exported: its callers name states and roles through it.
from pdserve.core.roles import (ACTIVE, DECODE, DRAINING, FAILED, GONE,  # noqa: F401
                                MEMBER_STATES, PREFILL, ROLES)

STATES = MEMBER_STATES



class InvalidBudgetError(ValueError):
    """An offload budget that cannot apply; the message starts with the offending field."""


@dataclass
class Member:
    """One worker as the router sees it."""

    address: str
    role: str  # PREFILL or DECODE: the pool it serves in (when ACTIVE)
    state: str = ACTIVE
    in_flight: int = 0  # requests sent and not yet seen end
    in_flight_tokens: float = 0.0  # predicted prefill work of those requests, in tokens
    offload_tokens: int = 0  # prompt tokens of offloaded (locally prefilled) requests in flight
    offload_budget: int = 0  # the most offload_tokens the controller allows (0: no offload)
    offload_chunk: int = 0  # prompt tokens per engine step for each offloaded request
    offload_step_s: float = 0.0  # predicted step carrying one such chunk (0: not given)
    stats: Any = None  # the last WorkerStats it reported (or alike); None before the first
    last_seen_s: float | None = None  # when it last answered a poll; None: never
    missed: int = 0  # consecutive polls it did not answer
    reason: str = ""  # why it is in this state, for operators
    gone_since_s: float | None = None  # when it became GONE (forget_gone counts from here)
    # A call to it got no first answer in time: GONE, and its polls bring it back only after
    # this (a slow worker gets that long to catch up before it is sent more).
    held_until_s: float = float("-inf")
    # When the controller last set its state or role: a poll asked before then may carry the
    # role it had before a switch, and must not move it back.
    changed_s: float = float("-inf")


@dataclass(frozen=True)
class Health:
    """Whether a request can be served now, why, and how many members can take each hop."""

    serving: bool
    summary: str  # why, as a client is told it (no addresses)
    decode_active: int  # ACTIVE decode members not draining: each can decode (and prefill)
    prefill_active: int  # ACTIVE prefill members not draining
    members: int  # every known member, in any state
    detail: str = ""  # for operators: the members and their states

    @property
    def reason(self) -> str:
        return f"{self.summary} ({self.detail})" if self.detail else self.summary


# Members named in a NOT_SERVING reason; the rest are counted.
_HEALTH_NAMED = 8


def reports_draining(m: Member) -> bool:
    """Its last stats say it is draining (a switch someone started by hand: it refuses every
    new request while the router still has it ACTIVE). Stats from before the controller's
    last move of it do not count: they may be from the drain of a switch now complete."""
    seen = m.last_seen_s if m.last_seen_s is not None else float("-inf")
    return bool(getattr(m.stats, "draining", False)) and seen >= m.changed_s


def _takes_requests(m: Member, role: str) -> bool:
    return m.state == ACTIVE and m.role == role and not reports_draining(m)


def health_of(members: list[Member]) -> Health:
    """SERVING exactly when some request can be served: a decode worker takes requests (ACTIVE,
    not draining). The prefill hop needs no prefill worker: without one, a decode worker
    prefills the prompt itself (`retry.prefill_fallback`; slower, same tokens), so prefill is
    possible whenever decode is."""
    decode = sum(_takes_requests(m, DECODE) for m in members)
    prefill = sum(_takes_requests(m, PREFILL) for m in members)
    if decode:
        how = (f"{prefill} prefill" if prefill else
               "no prefill worker (decode workers prefill prompts themselves) and")
        return Health(True, f"{how} {decode} decode workers take requests", decode, prefill,
                      len(members))
    if not members:
        return Health(False, "no decode worker is active", 0, prefill, 0,
                      "no worker has joined")
    named = []
    for m in members[:_HEALTH_NAMED]:
        draining = " draining" if m.state == ACTIVE and reports_draining(m) else ""
        why = f": {m.reason}" if m.reason and m.state != ACTIVE else ""
        named.append(f"{m.address} {m.role} {m.state}{draining}{why}")
    more = len(members) - len(named)
    listed = "; ".join(named) + (f"; and {more} more" if more > 0 else "")
    return Health(False, "no decode worker is active", 0, prefill, len(members),
                  f"{len(members)} members: {listed}")


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    return role


class Membership:
    """The membership table. Not thread-safe: callers serialise access."""

    def __init__(self, max_missed: int = 3, forget_after_s: float = 300.0) -> None:
        if max_missed < 1:
            raise ValueError(f"max_missed must be >= 1, got {max_missed}")
        if forget_after_s < 0:
            raise ValueError(f"forget_after_s must be >= 0, got {forget_after_s}")
        self.max_missed = max_missed
        self.forget_after_s = forget_after_s
        self._members: dict[str, Member] = {}

    # ---- reading -------------------------------------------------------------------------------
    def get(self, address: str) -> Member:
        m = self._members.get(address)
        if m is None:
            raise UnknownMemberError(f"no worker {address!r} is known to this router")
        return m

    def __contains__(self, address: str) -> bool:
        return address in self._members

    def members(self) -> list[Member]:
        """Every known member, by address."""
        return [self._members[a] for a in sorted(self._members)]

    def pool(self, role: str) -> list[Member]:
        """The ACTIVE members of `role`, by address: a stable order, so an index a policy
        returns means the same worker until membership changes."""
        _check_role(role)
        return [m for m in self.members() if m.state == ACTIVE and m.role == role]

    def offload_candidates(self) -> list[Member]:
        """ACTIVE decode members the controller gave an offload budget, by address."""
        return [m for m in self.pool(DECODE) if m.offload_budget > 0]

    def serving(self) -> bool:
        """A request can be served (see `health_of`)."""
        return health_of(self.members()).serving

    def health(self) -> "Health":
        return health_of(self.members())

    # ---- transitions ---------------------------------------------------------------------------
    def join(self, address: str, role: str, now: float) -> Member:
        """A worker joins in `role` (from the router's flags or RegisterWorker); idempotent.

        New -> ACTIVE; GONE -> ACTIVE in `role` (it is back). An ACTIVE member keeps its pool:
        a registration may have left the worker just before a switch and arrive after it, so
        only a fresh poll (`report`) moves an ACTIVE member between pools. DRAINING and FAILED
        stay as they are: the controller put them there and takes them out.
        """
        _check_role(role)
        m = self._members.get(address)
        if m is None:
            m = self._members[address] = Member(address, role, reason="joined")
            return m
        if m.state == GONE:
            m.reason = "joined again"
            m.missed = 0
            m.gone_since_s = None
            m.state, m.role = ACTIVE, role
        return m

    def report(self, address: str, role: str, now: float, stats: Any = None,
               asked_s: float | None = None) -> Member | None:
        """A successful poll, asked at `asked_s`: it answered in `role`. None if the address
        was forgotten meanwhile (a poll answer that arrived late).

        A poll asked before the controller last moved the member (`changed_s`) counts for
        liveness and load only: its role may be from before a switch the controller has since
        completed, and must not move the member back.

        Resets the missed count and records the stats. GONE -> ACTIVE in `role`; an ACTIVE
        member reporting another role moves to that pool (someone switched it by hand, so the
        old pool would only be refused). DRAINING and FAILED members only record it: the
        controller decides when they serve again.
        """
        _check_role(role)
        m = self._members.get(address)
        if m is None:
            return None
        m.missed = 0
        m.last_seen_s = now
        if stats is not None:
            m.stats = stats
        if asked_s is not None and asked_s < m.changed_s:
            return m
        if m.state == GONE and now >= m.held_until_s:
            m.state, m.role = ACTIVE, role
            m.reason, m.gone_since_s = "answered its health poll again", None
        elif m.state == ACTIVE and m.role != role:
            m.reason = f"reported the {role} role (was {m.role})"
            m.role = role
        return m

    def missed(self, address: str, now: float) -> Member | None:
        """A poll it did not answer (unavailable or timed out). After `max_missed` in a row an
        ACTIVE or DRAINING member is GONE; a FAILED one stays FAILED (the controller's call).
        None if the address is not known."""
        m = self._members.get(address)
        if m is None:
            return None
        m.missed += 1
        if m.missed >= self.max_missed and m.state in (ACTIVE, DRAINING):
            m.state, m.gone_since_s = GONE, now
            m.reason = f"missed {m.missed} consecutive health polls"
        return m

    def stalled(self, address: str, why: str, now: float, hold_s: float) -> Member | None:
        """A call to it got no first answer in time (`why`): an ACTIVE or DRAINING member is
        GONE at once, as a dead one, and its polls bring it back no sooner than `hold_s` from
        now. None if the address is not known."""
        m = self._members.get(address)
        if m is None:
            return None
        if m.state in (ACTIVE, DRAINING):
            m.state, m.gone_since_s, m.reason = GONE, now, why
            m.held_until_s = now + hold_s
        return m

    def set_state(self, address: str, state: str, role: str | None = None, reason: str = "",
                  now: float | None = None) -> Member:
        """The controller moves a member. ACTIVE joins `role`'s pool (None keeps its role) with
        a fresh missed count; DRAINING and FAILED take it out of both pools; GONE marks it gone
        (forget_gone drops it later; `forget` drops it now). Raises UnknownMemberError."""
        if state not in STATES:
            raise ValueError(f"state must be one of {STATES}, got {state!r}")
        if role is not None:
            _check_role(role)
        m = self.get(address)
        if role is not None:
            m.role = role
        if state == ACTIVE:
            m.missed = 0
            m.held_until_s = float("-inf")
        if state == GONE and m.state != GONE:
            m.gone_since_s = now if now is not None else (m.last_seen_s or 0.0)
        elif state != GONE:
            m.gone_since_s = None
        m.state = state
        m.reason = reason or f"set {state} by the controller"
        if now is not None:
            m.changed_s = now
        return m

    def forget(self, address: str) -> Member | None:
        """Drops a member now; the dropped member, or None if it was not known."""
        return self._members.pop(address, None)

    def forget_gone(self, now: float) -> list[str]:
        """Drops members GONE for longer than `forget_after_s`; their addresses."""
        old = [a for a, m in self._members.items() if m.state == GONE
               and m.gone_since_s is not None and now - m.gone_since_s > self.forget_after_s]
        for a in old:
            del self._members[a]
        return old

    # ---- load ----------------------------------------------------------------------------------
    def acquire(self, address: str, tokens: float = 0.0, offload_tokens: int = 0) -> None:
        """A request was sent to `address`: count it (and its predicted work) in flight."""
        m = self.get(address)
        m.in_flight += 1
        m.in_flight_tokens += tokens
        m.offload_tokens += offload_tokens

    def release(self, address: str, tokens: float = 0.0, offload_tokens: int = 0) -> None:
        """The request ended. A member forgotten meanwhile is ignored: nothing to count."""
        m = self._members.get(address)
        if m is None:
            return
        m.in_flight = max(0, m.in_flight - 1)
        m.in_flight_tokens = max(0.0, m.in_flight_tokens - tokens)
        m.offload_tokens = max(0, m.offload_tokens - offload_tokens)

    def set_offload_budgets(self, budgets: Mapping[str, tuple]) -> None:
        """Replaces every offload budget: address -> (max prompt tokens in flight, chunk tokens
        per step[, predicted seconds of a step carrying one chunk: 0 or left out, none given]);
        members not named get none. Checked as a whole before anything changes, so a bad set
        leaves the old one in place. Raises InvalidBudgetError naming the field."""
        for address, b in budgets.items():
            max_tokens, chunk = b[0], b[1]
            step_s = b[2] if len(b) > 2 else 0.0
            m = self._members.get(address)
            if m is None or m.role != DECODE or m.state == GONE:
                raise InvalidBudgetError(f"budgets.address: {address!r} is not a decode worker "
                                         f"of this router")
            if max_tokens < 0:
                raise InvalidBudgetError(f"budgets.max_tokens: must be >= 0, got {max_tokens} "
                                         f"for {address}")
            if chunk < 0:
                raise InvalidBudgetError(f"budgets.chunk_tokens: must be >= 0, got {chunk} "
                                         f"for {address}")
            if not 0 <= step_s < math.inf:
                raise InvalidBudgetError(f"budgets.step_s: must be finite and >= 0, got "
                                         f"{step_s} for {address}")
        for m in self._members.values():
            given = budgets.get(m.address)
            if given is None:
                m.offload_budget, m.offload_chunk, m.offload_step_s = 0, 0, 0.0
            else:
                m.offload_budget, m.offload_chunk = given[0], given[1]
                m.offload_step_s = float(given[2]) if len(given) > 2 else 0.0
