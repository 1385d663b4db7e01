"""Several routers on one cluster, as `pdserve serve --routers 2` runs them: real processes.

Both routers serve the same client ports (SO_REUSEPORT) and follow one membership table on the
store master, where the workers joined by themselves. Both serve requests arriving at the
shared port; a worker the controller moves, or flips to the other role, is seen so by both
within the stated convergence time, and a worker killed with -9 is taken out by both; the
controller reads both (their requests in flight add up). Then one router is killed with -9
under about 20 streams per router: the other router's streams all finish, exactly, and each
stream of the killed router, retried at the same address, lands on the survivor and finishes
exactly too.
"""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest

from pdserve import rpc
from pdserve.controller.flip import Flipper
from pdserve.controller.routers import Routers
from pdserve.core.identity import ROUTER
from pdserve.core.roles import ACTIVE, DECODE, DRAINING, GONE, PREFILL
from pdserve.launcher.local import LocalCluster
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from pdserve.wire import role_from_proto
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_admission import prompt_ids

# A controller's move reaches every router this fast: the table answers its long polls at
# once, and a router applies a new table as it arrives.
CONVERGENCE_S = 1.0
# A worker killed with -9 is out of both routers' pools after their missed polls.
GONE_WITHIN_S = 15.0
STREAMS = 40  # over the shared port: the kernel spreads them, about 20 per router


@pytest.fixture(scope="module")
def two_routers(tiny_llama_dir):
    spec = cluster_spec(tiny_llama_dir, routers=2, decode_workers=2)
    with LocalCluster(spec) as cluster:
        yield cluster


def members(control: str) -> dict[str, tuple[str, str]]:
    """A router's membership: address -> (role, state)."""
    with rpc.make_channel(control, ROUTER) as ch:
        got = rpb_grpc.RouterControlStub(ch).ListWorkers(rpb.ListWorkersRequest(), timeout=10)
    state = {rpb.MEMBER_STATE_ACTIVE: ACTIVE, rpb.MEMBER_STATE_DRAINING: DRAINING,
             rpb.MEMBER_STATE_GONE: GONE}
    return {m.address: (role_from_proto(m.role), state.get(m.state, "failed"))
            for m in got.workers}


def signals(control: str) -> rpb.RouterSignals:
    with rpc.make_channel(control, ROUTER) as ch:
        return rpb_grpc.RouterControlStub(ch).GetSignals(rpb.GetSignalsRequest(window_s=600),
                                                         timeout=10)


def seen_by_all(cluster, address: str, want: tuple[str, str], within_s: float) -> float:
    """Seconds until every router lists `address` as `want` (fails past `within_s`)."""
    t0 = time.monotonic()
    while not all(members(c).get(address) == want for c in cluster.router_controls):
        got = [members(c).get(address) for c in cluster.router_controls]
        assert time.monotonic() - t0 < within_s, f"{address}: routers show {got}, not {want}"
        time.sleep(0.01)
    return time.monotonic() - t0


def generate(address: str, prompt: list[int], max_tokens: int,
             started: threading.Event | None = None):
    req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))
    req.token_ids.ids.extend(prompt)
    ids: list[int] = []
    # A connection of its own: as separate clients, each stream lands on the router the
    # kernel picks for it.
    with rpc.make_public_channel(address, own_connection=True) as ch:
        try:
            for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=300):
                ids += r.token_ids
                if started is not None:
                    started.set()
        except grpc.RpcError as e:
            return e.code().name, ids
    return "ok", ids


def test_both_routers_serve_the_shared_ports(two_routers):
    c = two_routers
    assert len(c.router_controls) == 2
    before = [len(signals(a).samples) for a in c.router_controls]
    admitted = sum(signals(a).admitted_output_tokens_total for a in c.router_controls)
    model = httpx.get(f"http://{c.http_address}/v1/models", timeout=30).json()["data"][0]["id"]
    for i in range(24):  # a new connection each: the kernel picks a router for each
        r = httpx.post(f"http://{c.http_address}/v1/completions", timeout=120, json={
            "model": model, "prompt": f"request {i}", "max_tokens": 2}, headers={
            "connection": "close"})
        assert r.status_code == 200, r.text
    served = [len(signals(a).samples) - b for a, b in zip(c.router_controls, before)]
    assert sum(served) == 24 and all(n > 0 for n in served), served
    # The decode work each admitted: its max_tokens, counted and kept in its sample.
    after = [signals(a) for a in c.router_controls]
    assert sum(x.admitted_output_tokens_total for x in after) - admitted == 24 * 2
    assert all(x.max_tokens == 2 for sig, b in zip(after, before) for x in sig.samples[b:])


def test_both_routers_follow_one_membership(two_routers):
    c = two_routers
    workers = {a: r for r in (PREFILL, DECODE) for a in c.worker_addresses(r)}
    for control in c.router_controls:  # the workers joined the table, not a router
        assert members(control) == {a: (r, ACTIVE) for a, r in workers.items()}
    routers = Routers(masters=c.store_address)
    try:
        assert sorted(routers.addresses()) == sorted(c.router_controls)
        target = c.worker_addresses(DECODE)[1]
        routers.move(target, DRAINING, None, "a test's drain")
        drained_s = seen_by_all(c, target, (DECODE, DRAINING), CONVERGENCE_S)
        routers.move(target, ACTIVE, DECODE, "back")
        seen_by_all(c, target, (DECODE, ACTIVE), CONVERGENCE_S)
        # A real flip (drain, switch, verify, re-admit) through the table: both follow it.
        flipper = Flipper(routers.move)
        try:
            there = flipper.flip(target, PREFILL, drain_timeout_s=60, reason="a test's flip")
            assert there.ok, there.error
            seen_by_all(c, target, (PREFILL, ACTIVE), CONVERGENCE_S)
            back = flipper.flip(target, DECODE, drain_timeout_s=60, reason="back")
            assert back.ok, back.error
            seen_by_all(c, target, (DECODE, ACTIVE), CONVERGENCE_S)
        finally:
            flipper.close()
    finally:
        routers.close()
    print(f"a drain reached both routers in {drained_s * 1000:.0f} ms")


@pytest.mark.scenario  # kill -9 under load: with the long scenarios (.ci/scenarios)
def test_kill_9_of_one_router_costs_none_of_the_others_streams(two_routers):
    c = two_routers
    prompt = prompt_ids(c, "Two front doors, one cluster. ")
    kind, ref = generate(c.router_address, prompt, 480)
    assert kind == "ok" and len(ref) == 480
    results: list = [None] * STREAMS
    started = [threading.Event() for _ in results]

    def one(i: int) -> None:
        results[i] = generate(c.router_address, prompt, 480, started[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(STREAMS)]
    for t in threads:
        t.start()
    for e in started:
        assert e.wait(120), "a stream got no token"
    held = [signals(a).in_flight_requests for a in c.router_controls]
    assert sum(held) == STREAMS and min(held) >= 5, held  # both carry streams
    # The controller's one view: both routers' requests in flight add up.
    routers = Routers(masters=c.store_address)
    from pdserve.controller.connector import LiveConnector

    connector = LiveConnector(routers)
    try:
        assert connector.signals(60).in_flight_requests == STREAMS
    finally:
        connector.close(0)
    victim = next(ch for ch in c.children if ch.probe == c.router_controls[0])
    victim.proc.kill()  # kill -9
    victim.proc.wait()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads)
    ok = [ids for kind, ids in results if kind == "ok"]
    cut = [(kind, ids) for kind, ids in results if kind != "ok"]
    # Every stream of the survivor finished, exactly; every stream of the victim was cut.
    assert ok == [ref] * held[1] and len(cut) == held[0], (held, [k for k, _ in cut])
    assert all(kind == "UNAVAILABLE" and ids == ref[:len(ids)] for kind, ids in cut)
    # Their clients retry at the same address: the survivor takes each, exactly.
    retried = [generate(c.router_address, prompt, 480) for _ in cut]
    assert retried == [("ok", ref)] * len(cut)


def test_a_worker_killed_is_taken_out_by_every_router(two_routers):
    c = two_routers
    # The other router died in the test before (if it ran): only live ones are asked.
    alive = [ch.probe for ch in c.children if ch.kind == "router" and ch.proc.poll() is None]
    victim_addr = c.worker_addresses(DECODE)[1]
    victim = next(ch for ch in c.children if ch.address == victim_addr)
    victim.proc.kill()
    victim.proc.wait()
    t0 = time.monotonic()
    while not all(members(a)[victim_addr][1] == GONE for a in alive):
        assert time.monotonic() - t0 < GONE_WITHIN_S, [members(a)[victim_addr] for a in alive]
        time.sleep(0.1)
    assert generate(c.router_address, prompt_ids(c, "Still served."), 8)[0] == "ok"
