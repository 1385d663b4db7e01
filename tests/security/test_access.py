"""The one table of who may call what inside the cluster, checked against the services the
protos define: every method has an answer, the operator may do anything a component may, a
component only what its work needs, and credentials that are not identities never get in."""

from __future__ import annotations

import pytest

from pdserve.core.identity import KINDS, Identity
from pdserve.proto import (controller_pb2, kvmaster_pb2, kvstore_pb2, router_pb2,
                           worker_pb2)
from pdserve.security import access
from pdserve.security.access import Caller, decide

SERVICES = [(m.DESCRIPTOR.services_by_name[name]) for m, name in (
    (worker_pb2, "Worker"), (kvmaster_pb2, "KVMaster"), (kvstore_pb2, "KVStore"),
    (router_pb2, "RouterControl"), (controller_pb2, "Controller"))]
METHODS = [(s.full_name, m.name) for s in SERVICES for m in s.methods]


def who(kind: str) -> Caller:
    return Caller(identity=Identity(kind, "x"))


@pytest.mark.parametrize("service,method", METHODS)
def test_every_internal_method_admits_the_operator_and_not_everyone(service, method):
    kinds = access.allowed_kinds(service, method)
    assert kinds, f"{service}/{method} admits nobody"
    assert "operator" in kinds
    assert decide(service, method, who("operator")).allowed
    if method not in ("GetLeader", "Stats"):  # numbers and a leader's address: any member
        assert set(kinds) != set(KINDS), f"{service}/{method} admits every kind"


@pytest.mark.parametrize("method", ["SetWorkerState", "SetOffloadBudgets", "ListWorkers",
                                    "GetSignals"])
def test_a_worker_cannot_steer_or_read_the_router(method):
    v = decide(access.ROUTER_CONTROL_SERVICE, method, who("worker"))
    assert (v.allowed, v.code, v.reason) == (False, "PERMISSION_DENIED", access.KIND_NOT_ALLOWED)


def test_a_worker_joins_and_the_controller_steers():
    assert decide(access.ROUTER_CONTROL_SERVICE, "RegisterWorker", who("worker")).allowed
    for method in ("SetWorkerState", "SetOffloadBudgets", "ListWorkers", "GetSignals"):
        assert decide(access.ROUTER_CONTROL_SERVICE, method, who("controller")).allowed


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "operator"])
def test_only_an_operator_uses_the_controllers_admin_api(kind):
    v = decide(access.CONTROLLER_SERVICE, "SetRole", who(kind))
    assert v.code == "PERMISSION_DENIED" and "operator" in v.message


def test_only_the_router_and_operators_drive_a_worker_and_only_the_controller_flips_it():
    assert decide(access.WORKER_SERVICE, "Prefill", who("router")).allowed
    for kind in ("worker", "node", "master", "controller"):
        assert decide(access.WORKER_SERVICE, "Prefill", who(kind)).refused
    for method in ("SetRole", "Migrate"):  # a flip, and moving decodes off a worker
        assert decide(access.WORKER_SERVICE, method, who("controller")).allowed
        assert decide(access.WORKER_SERVICE, method, who("operator")).allowed
        for kind in ("router", "worker", "node", "master"):
            assert decide(access.WORKER_SERVICE, method, who(kind)).refused


def test_kv_blocks_are_read_only_by_workers_and_moved_by_the_master():
    for kind, allowed in (("worker", True), ("master", True), ("operator", True),
                          ("router", False), ("controller", False), ("node", False)):
        assert decide(access.DATA_PLANE, "*", who(kind)).allowed is allowed
        assert decide(access.MASTER_SERVICE, "Get", who(kind)).allowed is (
            allowed and kind != "master")


@pytest.mark.parametrize("service", sorted(access.ADMIN_KEY_SERVICES))
def test_keys_on_the_control_apis(service):
    method = "SetWorkerState" if service == access.ROUTER_CONTROL_SERVICE else "SetRole"
    v = decide(service, method, Caller(admin="alice", bearer=True))
    assert v.allowed and v.who == "key:alice"
    v = decide(service, method, Caller(bearer=True, tenant_key=True))
    assert (v.code, v.reason) == ("PERMISSION_DENIED", access.TENANT_KEY)
    v = decide(service, method, Caller(bearer=True))
    assert (v.code, v.reason) == ("UNAUTHENTICATED", access.UNKNOWN_KEY)
    v = decide(service, method, Caller())
    assert (v.code, v.reason) == ("UNAUTHENTICATED", access.NO_CREDENTIAL)
    v = decide(service, method, Caller(bad_identity="the certificate was not issued by this "
                                                    "cluster's CA"))
    assert (v.code, v.reason) == ("UNAUTHENTICATED", access.BAD_IDENTITY)


def test_an_admin_key_opens_no_data_service():
    v = decide(access.WORKER_SERVICE, "Prefill", Caller(admin="alice", bearer=True))
    assert v.refused and v.code == "UNAUTHENTICATED"


def test_refusals_never_repeat_a_credential():
    secret = "sk-very-secret-123"
    for caller in (Caller(bearer=True), Caller(bearer=True, tenant_key=True), Caller()):
        v = decide(access.CONTROLLER_SERVICE, "SetRole", caller)
        assert secret not in v.message and "Bearer" not in v.message.split("'")[0]


def test_health_and_reflection_are_open_and_unknown_services_closed():
    assert decide(access.HEALTH_SERVICE, "Check", Caller()).allowed
    v = decide("pdserve.v1.Nope", "X", who("operator"))
    assert v.refused and v.reason == access.UNKNOWN_METHOD
