"""Running decodes moved with their KV in the simulator: a decode worker's flip that moves
them ends sooner than one that waits for them and loses none; the controller's balance moves
the count it asks for, those with the most tokens left first; the next worker computes only
the last partial block; and the choices match the live system's on the same inputs (the
router's resume target, the controller's flips and balance moves through its connector)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from pdserve.compiled import compiled
from pdserve.controller import service as controller_service
from pdserve.controller.config import ControllerConfig
from pdserve.controller.flip import MigrateOutcome
from pdserve.controller.policy import Migration, PolicyConfig
from pdserve.controller.service import Controller
from pdserve.controller.signals import Slo
from pdserve.core.step_profile import load_profile
from pdserve.router.control import RequestSignals, RouterControlServicer
from pdserve.router.policy import NoWorkerError, make_policy
from pdserve.router.pool import WorkerSet
from pdserve.sim import control
from pdserve.sim.cluster import Cluster
from pdserve.sim.config import SimConfig
from pdserve.sim.engine_model import EngineModel
from pdserve.sim.migration import most_left
from pdserve.sim.router import SimRouter
from pdserve.sim.trace import SimRequest
from tests.sim.test_sim_cores import _LiveConnector, _SimCluster, _stats

H100 = load_profile("h100-llama3-8b")
BS = 16


def _cluster(requests, at_s: float, act, **cfg) -> Cluster:
    """A 1P2D cluster whose controller, deciding nothing itself, calls `act(cluster)` at its
    first tick at or after `at_s` (through the tick: the cluster may run compiled, and a
    compiled class takes no subclass or patch)."""
    policy = PolicyConfig(fluid_role=False, fluid_token=False)
    c = Cluster(SimConfig(prefill_workers=1, decode_workers=2, block_size=BS, controller=True,
                          policy=policy, tick_s=0.25, **cfg), requests, H100)
    assert c.ctl is not None
    tick, pending = c.ctl.tick, [act]

    def act_then_tick():
        if pending and c.q.now >= at_s:
            pending.pop()(c)
        return tick()

    c.ctl.tick = act_then_tick
    return c


def _long_answers(n: int = 12) -> list[SimRequest]:
    """`n` long answers at once, and a short one long after (the run lasts past the flips)."""
    return [*(SimRequest(f"r{i}", 0.02 * i, 900 + 37 * i, 1500 + 50 * i) for i in range(n)),
            SimRequest("late", 120.0, 100, 2)]


def _flip(migrate: bool):
    """A run that flips decode worker w0001 to prefill mid-answers: (cluster, report, the
    flip's outcome)."""
    out = []

    def act(c: Cluster) -> None:
        assert c.workers["w0001"].engine.running > 0  # long answers are running there
        c.begin_flip("w0001", "prefill", 1e9, out.append, migrate=migrate)

    c = _cluster(_long_answers(), 2.0, act)
    report = c.run()
    return c, report, out[0]


def test_a_flip_that_moves_decodes_ends_sooner_and_loses_no_request():
    _, moved, out = _flip(migrate=True)
    _, waited, slow = _flip(migrate=False)
    assert out.ok and slow.ok and out.to_role == "prefill"
    assert out.moved_requests > 0 and slow.moved_requests == 0
    assert out.seconds < slow.seconds / 5  # no waiting for 1,500-token answers to end
    for r in (moved, waited):
        assert all(st == "ok" for st in r.status)  # no request lost
    s = moved.summary()
    assert s["migrations"] == {"drain": out.moved_requests}
    assert s["migration_bytes"] > 0 and s["migration_fetch_bytes"] > 0
    assert s["migration_stall_s"]["n"] == out.moved_requests
    assert 0 < s["migration_stall_s"]["p99"] < 1.0
    assert waited.summary()["migrations"] == {} and waited.summary()["migration_stall_s"]["n"] == 0
    # Each went on with only its last, partial block computed again: the rest was fetched.
    assert 0 < s["migration_recomputed_tokens"] <= out.moved_requests * BS


@pytest.mark.skipif("pdserve.sim.engine_model" in compiled(),
                    reason="spies on the engine adapter's methods, which a compiled one fixes")
def test_the_next_worker_computes_only_the_last_partial_block(monkeypatch):
    """Through the real scheduler: a moved request's first step on the next worker computes
    at most a block of the tokens it had (hundreds made on the first worker); its prefix
    cache holds the rest, fetched from the store."""
    first: dict[str, tuple[int, int]] = {}  # request id -> (tokens it had, computed at once)
    plan, resume = EngineModel.plan, EngineModel.resume

    def spy_resume(self, rid, prompt, token_ids, *args):
        first[rid] = (len(token_ids), 0)
        return resume(self, rid, prompt, token_ids, *args)

    def spy_plan(self):
        step = plan(self)
        for seq, n in zip(step.batch.seqs, step.batch.num_new) if step else ():
            if first.get(seq.request_id, (0, 1))[1] == 0:
                first[seq.request_id] = (first[seq.request_id][0], n)
        return step

    monkeypatch.setattr(EngineModel, "plan", spy_plan)
    monkeypatch.setattr(EngineModel, "resume", spy_resume)
    _, report, out = _flip(migrate=True)
    assert len(first) == out.moved_requests > 0
    for rid, (had, computed) in first.items():
        assert report.decode_worker[int(rid)] == "w0002"
        assert had > report.prompt_tokens[int(rid)] + 100
        assert 1 <= computed <= BS


def test_with_no_store_to_move_them_through_a_flip_lets_decodes_finish_in_place():
    c = _cluster(_long_answers(4), 1.0, lambda c: c.begin_flip(
        "w0001", "prefill", 1e9, lambda out: None, migrate=True), store_capacity_blocks=0)
    r = c.run()
    assert r.summary()["migrations"] == {} and all(st == "ok" for st in r.status)
    assert r.summary()["flips"] == 1


def _balance(count: int):
    reqs = [SimRequest(f"r{i}", 0.01 * i, 600, 300 + 97 * ((i * 7) % 10)) for i in range(10)]
    got, picked = [], {}

    def act(c: Cluster) -> None:
        on = {int(rid): c.reqs[int(rid)].output_tokens
              for rid in c.workers["w0001"].engine.seqs}
        picked["on"] = on
        c.migrate("w0001", count, "balance", got.append)

    c = _cluster(reqs, 1.0, act)
    return c, c.run(), got, picked["on"]


def test_a_balance_moves_the_requested_count_longest_remaining_first():
    c, r, got, on = _balance(2)
    assert len(got) == 1
    out = got[0]
    assert (out.address, out.requested, out.moved, out.error) == ("w0001", 2, 2, "")
    assert 0 < out.seconds < 1.0
    assert len(on) >= 4
    # All started together and decode in step: the longest answers have the most tokens left.
    longest = sorted(on, key=lambda i: -on[i])[:2]
    assert {i for i in on if r.decode_worker[i] == "w0002"} == set(longest)
    assert c.workers["w0001"].role == "decode" and c.workers["w0001"].switches == 0
    s = r.summary()
    assert s["migrations"] == {"balance": 2} and s["migration_stall_s"]["n"] == 2
    assert all(st == "ok" for st in r.status)


def test_a_balance_asking_more_than_run_moves_them_all_and_a_refused_one_says_why():
    c, r, got, on = _balance(100)
    assert got[0].moved == len(on) and got[0].requested == 100
    assert all(st == "ok" for st in r.status)
    refused = []
    c = _cluster(_long_answers(2), 0.5, lambda c: (
        c.migrate("w0000", 1, "balance", refused.append),  # the prefill worker
        c.migrate("w0001", 0, "balance", refused.append)))
    c.run()
    assert [o.moved for o in refused] == [0, 0]
    assert "FAILED_PRECONDITION" in refused[0].error and "count" in refused[1].error


def test_most_left_ranks_by_tokens_left_then_request_id():
    assert most_left({"a": 5, "b": 9, "c": 5, "d": 1}, 3) == ["b", "a", "c"]
    assert most_left({"a": 5}, 4) == ["a"] and most_left({"a": 5}, 0) == []


@pytest.mark.parametrize("decode_policy", ["free_kv", "power_of_two", "least_loaded"])
def test_a_moved_decode_resumes_where_the_live_worker_set_would_put_it(decode_policy):
    """The live router resumes a moved decode with `WorkerSet.pick(DECODE, exclude={its
    worker})`; the simulated router's pick leaving the same worker out chooses the same."""
    decode = ["d0", "d1", "d2", "d3"]
    now = [0.0]
    live = WorkerSet(["p0"], decode, prefill_policy=make_policy("least_loaded"),
                     decode_policy=make_policy(decode_policy, seed=6), block_size_tokens=BS,
                     stats_interval_s=0, clock=lambda: now[0])
    sim = SimRouter(SimConfig(prefill_workers=1, decode_workers=4, decode_policy=decode_policy,
                              prefill_policy="least_loaded", seed=5, block_size=BS),
                    {"p0": "prefill", **{a: "decode" for a in decode}})
    rng = random.Random(3)
    held, resumes = [], 0
    try:
        for step in range(300):
            now[0] = step * 0.1
            kind = rng.choice(("report", "pick", "resume", "release"))
            if kind == "report":
                a = rng.choice(decode)
                stats = _stats(rng, "decode")
                live.report(a, stats, now=now[0], asked_s=now[0])
                sim.report(a, "decode", stats, now[0])
            elif kind == "release" and held:
                ctx, address, tokens = held.pop(rng.randrange(len(held)))
                ctx.__exit__(None, None, None)
                sim.release(address, tokens)
            elif kind in ("pick", "resume"):
                n, extra = rng.randrange(1, 3000), rng.randrange(1, 500)
                out = frozenset(rng.sample(decode, rng.randrange(1, 4))) if kind == "resume" \
                    else frozenset()
                ctx = live.pick("decode", list(range(n)), extra_tokens=extra, exclude=out)
                live_address, _ = ctx.__enter__()
                address, tokens = sim.pick("decode", n, extra, exclude=out)
                assert address == live_address and address not in out, f"step {step}"
                held.append((ctx, address, tokens))
                resumes += kind == "resume"
        assert resumes > 50
        with pytest.raises(NoWorkerError):
            sim.pick("decode", 10, 10, exclude=frozenset(decode))
    finally:
        live.close()


def _twins(migrate: bool):
    """The live controller over the live connector's router side and over `SimConnector`,
    fed the same signals (as `test_sim_cores`'s controller parity test)."""
    roles = {"w0": "prefill", "w1": "decode", "w2": "decode", "w3": "decode"}
    now = [0.0]
    live_ws = WorkerSet(["w0"], ["w1", "w2", "w3"], prefill_policy=make_policy("least_loaded"),
                        decode_policy=make_policy("free_kv"), stats_interval_s=0,
                        clock=lambda: now[0])
    live_conn = _LiveConnector(RouterControlServicer(live_ws, RequestSignals(),
                                                     clock=lambda: now[0]))
    cfg = dict(cooldown_s=5.0, migrate=migrate)
    live = Controller(ControllerConfig(router_address="live", **cfg), live_conn,
                      clock=lambda: now[0], slo=Slo(2.0, 0.2))
    sim_router = SimRouter(SimConfig(prefill_workers=1, decode_workers=3), roles)
    cluster = _SimCluster(sim_router, now)
    sim = Controller(ControllerConfig(router_address="simulated", **cfg),
                     control.SimConnector(cluster), clock=lambda: now[0],
                     policy_cfg=PolicyConfig(cooldown_s=5.0), slo=Slo(2.0, 0.2))
    return roles, now, live_ws, live_conn, live, sim_router, cluster, sim


@pytest.mark.parametrize("migrate", [True, False])
def test_balance_moves_are_decided_alike_live_and_simulated(monkeypatch, migrate):
    """A decision naming a balance move (the busiest decode worker's two longest) reaches
    both connectors alike, or neither with `migrate` off; one under way is not asked again
    until its outcome came back; the outcomes count alike."""
    real = controller_service.decide

    def decide_with_balance(inp, now, cfg):
        d = real(inp, now, cfg)
        busiest = max((w for w in inp.workers if w.role == "decode"),
                      key=lambda w: (w.running, w.address))
        return dataclasses.replace(d, migrations=(Migration(busiest.address, 2, "balance"),))

    monkeypatch.setattr(controller_service, "decide", decide_with_balance)
    roles, now, live_ws, live_conn, live, sim_router, cluster, sim = _twins(migrate)
    rng = random.Random(4)
    try:
        for tick in range(1, 30):
            now[0] = float(tick)
            for a, role in roles.items():
                stats = _stats(rng, role)
                stats.busy_seconds, stats.decode_steps = float(tick), tick * 20
                stats.decode_step_seconds = tick * 0.5
                live_ws.report(a, stats, now=now[0], asked_s=now[0])
                sim_router.report(a, role, stats, now[0])
            d_live, d_sim = live.tick(), sim.tick()
            assert d_sim.migrations == d_live.migrations, f"tick {tick}"
            assert [m[:2] for m in cluster.migrations] == [m[:2] for m in live_conn.migrations]
            assert len({m[0] for m in cluster.migrations}) == len(cluster.migrations)
            assert live.migrating == sim.migrating
            if tick % 3 == 0:  # the moves end every third tick
                for side in (live_conn, cluster):
                    for address, count, done in side.migrations:
                        done(MigrateOutcome(address, count, count - 1, 0.5))
                    side.migrations.clear()
            assert live.migrations_total == sim.migrations_total
    finally:
        live_ws.close()
    assert (sim.migrations_total > 0) == migrate


def test_the_simulated_connector_moves_decodes_in_the_cluster_for_the_live_controller():
    """`SimConnector.migrate` reaches the simulated cluster and its outcome, on the virtual
    clock, reaches the live controller's record."""
    ctl = []

    def act(c: Cluster) -> None:
        ctl.append(c.ctl)
        c.ctl.start_migration("w0001", 1, "balance")
        assert c.ctl.migrating == {"w0001"}

    r = _cluster(_long_answers(6), 1.0, act).run()
    assert ctl and ctl[0].migrating == set() and ctl[0].migrations_total == 1
    assert r.summary()["migrations"] == {"balance": 1}
    assert all(st == "ok" for st in r.status)
