"""Who may call what inside the cluster: one table, and the pure decision over a caller.

Owns `RULES` (for every internal service, the component kinds each method admits; a kind not
listed is refused even with a valid certificate), which services also take an admin key (the
two an operator steers: the router's control API and the controller), and `decide()`: a
caller (its identity, proven by certificate, and the keys it sent) in, a `Verdict` out
(allowed, or UNAUTHENTICATED / PERMISSION_DENIED with a reason for the failure counter and a
message that never repeats a credential). Pure: no I/O, no clock. Must not know gRPC or
sockets; `pdserve.rpc` and the store's data plane apply it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.identity import (CONTROLLER, KINDS, MASTER, NODE, OPERATOR, ROUTER, WORKER,
                                   Identity)

WORKER_SERVICE = "pdserve.v1.Worker"
MASTER_SERVICE = "pdserve.v1.KVMaster"
STORE_SERVICE = "pdserve.v1.KVStore"  # the single-process store (master and data in one)
MEMBERS_SERVICE = "pdserve.v1.ClusterMembers"  # the cluster's membership, on the master
ROUTER_CONTROL_SERVICE = "pdserve.v1.RouterControl"
CONTROLLER_SERVICE = "pdserve.v1.Controller"
DATA_PLANE = "pdserve.data"  # a storage node's TCP data plane (not gRPC)
HEALTH_SERVICE = "grpc.health.v1.Health"
REFLECTION_SERVICES = ("grpc.reflection.v1alpha.ServerReflection",
                       "grpc.reflection.v1.ServerReflection")

ANY = frozenset(KINDS)
_K = frozenset

# service -> method -> the kinds it admits; "*" answers for the service's other methods. The
# operator kind is an administrator's certificate (the launcher's, `pdserve ctl`'s): it may do
# anything a component may.
RULES: dict[str, dict[str, frozenset[str]]] = {
    WORKER_SERVICE: {
        "*": _K({ROUTER, OPERATOR}),  # Prefill, Decode, DecodeMany, Abort, WatchKvEvents
        "SetRole": _K({CONTROLLER, OPERATOR}),
        "Migrate": _K({CONTROLLER, OPERATOR}),  # the controller's balance moves decodes
        "GetStats": _K({ROUTER, CONTROLLER, OPERATOR}),
    },
    MASTER_SERVICE: {
        "*": _K({WORKER, OPERATOR}),  # puts, gets, pins, removals, prefix lookups
        "RegisterNode": _K({NODE, OPERATOR}),
        "Heartbeat": _K({NODE, OPERATOR}),
        "WatchEvents": _K({ROUTER, OPERATOR}),
        "GetLeader": ANY,
        "Stats": ANY,
    },
    STORE_SERVICE: {"*": _K({WORKER, OPERATOR}), "Stats": ANY},
    # Workers and routers join the cluster; the controller moves workers; routers follow.
    MEMBERS_SERVICE: {
        "Join": _K({WORKER, ROUTER, OPERATOR}),
        "SetMemberState": _K({CONTROLLER, OPERATOR}),
        "WatchMembers": _K({ROUTER, CONTROLLER, OPERATOR}),
    },
    ROUTER_CONTROL_SERVICE: {
        "*": _K({ROUTER, CONTROLLER, OPERATOR}),
        "RegisterWorker": _K({WORKER, ROUTER, CONTROLLER, OPERATOR}),
    },
    CONTROLLER_SERVICE: {"*": _K({OPERATOR})},
    # Workers read and write KV; the master moves blocks from DRAM to SSD.
    DATA_PLANE: {"*": _K({WORKER, MASTER, OPERATOR})},
}
# Health and reflection answer any caller the listener let in (a cluster certificate, or on
# the control listeners any TLS client: a probe needs no credential to learn SERVING).
OPEN_SERVICES = frozenset({HEALTH_SERVICE, *REFLECTION_SERVICES})
# Services an operator reaches with an admin key alone (no certificate): their listeners take
# TLS without a client certificate and authenticate every call instead.
ADMIN_KEY_SERVICES = frozenset({ROUTER_CONTROL_SERVICE, CONTROLLER_SERVICE})
# What each kind of process serves on its internal listener.
SERVES: dict[str, tuple[str, ...]] = {
    WORKER: (WORKER_SERVICE,), MASTER: (MASTER_SERVICE, STORE_SERVICE, MEMBERS_SERVICE),
    NODE: (DATA_PLANE,), ROUTER: (ROUTER_CONTROL_SERVICE,), CONTROLLER: (CONTROLLER_SERVICE,),
}

# Failure reasons (the `reason` label of pdserve:auth_failures_total).
NO_CREDENTIAL = "no_credential"
BAD_IDENTITY = "bad_identity"  # an identity proof that does not verify against the cluster CA
UNKNOWN_KEY = "unknown_key"
TENANT_KEY = "tenant_key"
KIND_NOT_ALLOWED = "kind_not_allowed"
UNKNOWN_METHOD = "unknown_method"
REASONS = (NO_CREDENTIAL, BAD_IDENTITY, UNKNOWN_KEY, TENANT_KEY, KIND_NOT_ALLOWED,
           UNKNOWN_METHOD)


@dataclass(frozen=True)
class Caller:
    """What a call proved: a verified identity (None: none, or `bad_identity` says why), the
    name of a matching admin key, and whether it sent some other bearer key (a tenant's key
    when `tenant_key`, else an unknown one)."""

    identity: Identity | None = None
    admin: str | None = None
    bad_identity: str = ""  # why an identity proof did not verify ("" if none was sent)
    bearer: bool = False  # an `authorization: Bearer` key was sent
    tenant_key: bool = False  # ... and it is a tenant's API key


@dataclass(frozen=True)
class Verdict:
    allowed: bool
    code: str = "OK"  # else "UNAUTHENTICATED" or "PERMISSION_DENIED"
    reason: str = ""  # one of REASONS when refused
    message: str = ""
    who: str = ""  # "key:NAME" or "cert:KIND/NAME": for audit lines

    @property
    def refused(self) -> bool:
        return not self.allowed


def split_method(full: str) -> tuple[str, str]:
    """("pdserve.v1.Worker", "Prefill") from "/pdserve.v1.Worker/Prefill"."""
    service, _, method = full.lstrip("/").rpartition("/")
    return service, method


def allowed_kinds(service: str, method: str) -> frozenset[str] | None:
    """The kinds `service`/`method` admits; None for a service the table does not know."""
    rules = RULES.get(service)
    if rules is None:
        return None
    return rules.get(method, rules.get("*", frozenset()))


def decide(service: str, method: str, caller: Caller) -> Verdict:
    """Whether `caller` may call `service`/`method`. An admin key (where the service takes
    one) or an identity of an admitted kind allows; a tenant's key is PERMISSION_DENIED; a
    known identity of another kind is PERMISSION_DENIED; nothing valid is UNAUTHENTICATED."""
    if service in OPEN_SERVICES:
        return Verdict(True, who=_who(caller))
    kinds = allowed_kinds(service, method)
    if kinds is None:
        return Verdict(False, "PERMISSION_DENIED", UNKNOWN_METHOD,
                       f"{service}/{method} is not served to cluster callers")
    if caller.admin is not None and service in ADMIN_KEY_SERVICES:
        return Verdict(True, who=f"key:{caller.admin}")
    if caller.identity is not None:
        if caller.identity.kind in kinds:
            return Verdict(True, who=f"cert:{caller.identity}")
        return Verdict(False, "PERMISSION_DENIED", KIND_NOT_ALLOWED,
                       f"a {caller.identity.kind} may not call {service}/{method} (it admits "
                       f"{', '.join(sorted(kinds))})", f"cert:{caller.identity}")
    if caller.tenant_key:
        return Verdict(False, "PERMISSION_DENIED", TENANT_KEY,
                       "a tenant API key cannot call the cluster's control API; use an admin key")
    if caller.bad_identity:
        return Verdict(False, "UNAUTHENTICATED", BAD_IDENTITY,
                       f"the identity proof was refused: {caller.bad_identity}")
    if caller.bearer:
        return Verdict(False, "UNAUTHENTICATED", UNKNOWN_KEY, "unknown key")
    needs = ("an admin key ('authorization: Bearer <key>') or a cluster certificate"
             if service in ADMIN_KEY_SERVICES else "a cluster certificate")
    return Verdict(False, "UNAUTHENTICATED", NO_CREDENTIAL, f"{service} needs {needs}")


def _who(caller: Caller) -> str:
    if caller.admin is not None:
        return f"key:{caller.admin}"
    return f"cert:{caller.identity}" if caller.identity is not None else ""
