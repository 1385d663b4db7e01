"""The simulator runs the project's cores, not copies of them: it imports them without torch,
defines nothing named like them, and, given the same inputs, makes the decisions the live
router's worker set and the live controller's tick make."""

from __future__ import annotations

import ast
import random
import subprocess
import sys
from pathlib import Path

import pytest

import pdserve.sim
from pdserve.controller import policy as controller_policy
from pdserve.controller.config import ControllerConfig
from pdserve.controller.policy import PolicyConfig
from pdserve.controller.service import Controller
from pdserve.controller.signals import Slo
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import worker_pb2 as wpb
from pdserve.router import admission, deflect, kv_index, membership
from pdserve.router import policy as router_policy
from pdserve.router.control import RequestSignals, RouterControlServicer, Sample
from pdserve.router.policy import PREFILL_POLICIES, make_policy
from pdserve.router.picks import LiveRequest
from pdserve.router.pool import WorkerSet
from pdserve.sim import cluster, control, router as sim_router
from pdserve.sim.config import SimConfig
from pdserve.controller.flip import FlipOutcome
from pdserve.sim.router import SimRouter

SIM_DIR = Path(pdserve.sim.__file__).parent
PACKAGE_DIR = SIM_DIR.parent
MODULES = ("events", "trace", "config", "engine_model", "router", "control", "worker", "cluster",
           "arrival", "flips", "run", "report", "cli_run", "migration")


def _fresh(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)


def test_the_simulator_imports_without_torch():
    mods = ", ".join(f"pdserve.sim.{m}" for m in MODULES)
    out = _fresh(f"import sys, {mods}\nassert 'torch' not in sys.modules, 'torch imported'")
    assert out.returncode == 0, out.stderr


def test_a_simulation_runs_without_torch():
    """The scheduler is reached through `engine_model` only; with the engine's scheduler
    torch-free, a whole run never loads torch."""
    out = _fresh("import sys\n"
                 "from pdserve.sim.config import SimConfig\n"
                 "from pdserve.core.step_profile import load_profile\n"
                 "from pdserve.sim.run import simulate\n"
                 "from pdserve.sim.trace import load_trace\n"
                 "r = simulate(SimConfig(), load_trace('synthetic:poisson:n=5'), "
                 "load_profile('h100-llama3-8b'))\n"
                 "assert r.summary()['finished'] == 5\n"
                 "assert 'torch' not in sys.modules, 'torch imported'")
    assert out.returncode == 0, out.stderr


def test_the_simulator_calls_the_cores_themselves():
    assert sim_router.make_policy is router_policy.make_policy
    assert sim_router.deflect is deflect.deflect
    assert sim_router.pool_side is deflect.pool_side
    assert sim_router.Admission is admission.Admission
    assert sim_router.KvIndex is kv_index.KvIndex
    assert sim_router.Membership is membership.Membership
    assert control.Controller is Controller  # the live controller's tick, not a copy
    r = SimRouter(SimConfig(prefill_workers=1, decode_workers=1, prefill_policy="kv_aware"),
                  {"a": "prefill", "b": "decode"})
    assert type(r.policies["prefill"]) is router_policy.KvAware
    assert type(r.policies["decode"]) is router_policy.DecodeChooser
    assert cluster.SimRouter is SimRouter


def _defined_names(path: Path, top_level: bool = False) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level else ast.walk(tree)
    return {n.name for n in nodes
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}


def test_no_policy_code_is_copied_into_the_simulator():
    """No function or class under sim/ is named like a routing, admission, index, membership
    or controller core (their module-level names, and the policies' deciding methods)."""
    cores = (router_policy, admission, kv_index, membership, controller_policy)
    core_names = {"decide", "score", "choose"}
    for mod in cores:
        # The source, also when the module runs compiled (`__file__` is then the extension).
        source = PACKAGE_DIR / (mod.__name__.split(".", 1)[1].replace(".", "/") + ".py")
        core_names |= {n for n in _defined_names(source, top_level=True)
                       if not n.startswith("_")}
    assert {"KvAware", "decide", "Membership", "Admission", "KvIndex"} <= core_names
    for path in sorted(SIM_DIR.glob("*.py")):
        clash = _defined_names(path) & core_names
        assert not clash, f"{path.name} defines {sorted(clash)}, named like the cores'"


def _stats(rng: random.Random, role: str) -> wpb.WorkerStats:
    return wpb.WorkerStats(role=wpb.ROLE_PREFILL if role == "prefill" else wpb.ROLE_DECODE,
                           num_running=rng.randrange(8), num_waiting=rng.randrange(3),
                           num_free_blocks=rng.randrange(200), num_total_blocks=200,
                           prompt_tokens_computed=rng.randrange(10_000), busy_seconds=1.0)


@pytest.mark.parametrize("prefill_policy", PREFILL_POLICIES)
@pytest.mark.parametrize("decode_policy", ["free_kv", "power_of_two", "least_loaded"])
def test_routing_decisions_match_the_live_worker_set(prefill_policy, decode_policy):
    roles = {"p0": "prefill", "p1": "prefill", "p2": "prefill", "d0": "decode", "d1": "decode",
             "d2": "decode"}
    now = [0.0]
    live = WorkerSet(["p0", "p1", "p2"], ["d0", "d1", "d2"],
                     prefill_policy=make_policy(prefill_policy, seed=5),
                     decode_policy=make_policy(decode_policy, seed=6), block_size_tokens=16,
                     stats_interval_s=0, clock=lambda: now[0])
    sim = SimRouter(SimConfig(prefill_workers=3, decode_workers=3, prefill_policy=prefill_policy,
                              decode_policy=decode_policy, seed=5), roles)
    rng = random.Random(1)
    held = []  # (live context, sim address, sim tokens)
    picks = 0
    try:
        for step in range(200):
            now[0] = step * 0.1
            kind = rng.choice(("prefill", "decode", "release", "report"))
            if kind == "report":
                a = rng.choice(sorted(roles))
                stats = _stats(rng, roles[a])
                live.report(a, stats, now=now[0], asked_s=now[0])
                sim.report(a, roles[a], stats, now[0])
            elif kind == "release" and held:
                ctx, address, tokens = held.pop(rng.randrange(len(held)))
                ctx.__exit__(None, None, None)
                sim.release(address, tokens)
            elif kind in ("prefill", "decode"):
                n, extra = rng.randrange(1, 3000), rng.randrange(0, 500) * (kind == "decode")
                ctx = live.pick(kind, list(range(n)), extra_tokens=extra)
                live_address, _ = ctx.__enter__()
                address, tokens = sim.pick(kind, n, extra)
                assert address == live_address, f"step {step}: {kind} pick differs"
                held.append((ctx, address, tokens))
                picks += 1
        live_members = {m.address: (m.in_flight, m.in_flight_tokens) for m in live.members()}
        sim_members = {m.address: (m.in_flight, m.in_flight_tokens) for m in sim.members()}
        assert live_members == sim_members
        assert picks > 80
    finally:
        live.close()


class _LiveConnector:
    """The live connector's router side (`controller.connector.LiveConnector`), answered by
    the router's real control servicer over a live `WorkerSet`; flips are recorded, and end
    (ok or failed) when the test says, as workers would."""

    def __init__(self, servicer: RouterControlServicer) -> None:
        self.servicer = servicer
        self.started: list[tuple] = []
        self.readmitted: list[str] = []
        self.migrations: list[tuple] = []

    def signals(self, window_s):
        return self.servicer.GetSignals(rpb.GetSignalsRequest(window_s=window_s), None)

    def switching(self):
        return {a: to for a, to, *_ in self.started}

    def set_budgets(self, budgets):
        self.servicer.SetOffloadBudgets(rpb.SetOffloadBudgetsRequest(budgets=[
            rpb.OffloadBudget(address=b.address, max_tokens=b.max_tokens,
                              chunk_tokens=b.chunk_tokens, step_s=b.step_s)
            for b in budgets]), None)

    def start_flip(self, address, to_role, reason, drain_timeout_s, done, migrate=True):
        self.started.append((address, to_role, lambda out: done(out, reason), migrate))

    def migrate(self, address, count, reason, done):
        self.migrations.append((address, count, done))

    def readmit(self, address, reason):
        self.readmitted.append(address)
        return "decode"

    def close(self, wait_s):
        pass


class _Clock:
    def __init__(self, now: list[float]) -> None:
        self._now = now

    @property
    def now(self) -> float:
        return self._now[0]


class _SimCluster:
    """What `sim.control.SimConnector` reaches of the simulated cluster: its router and
    virtual clock; flips and migrations begun are recorded and end when the test says."""

    def __init__(self, router: SimRouter, now: list[float]) -> None:
        self.router = router
        self.q = _Clock(now)  # the event queue's virtual clock
        self.started: list[tuple] = []
        self.readmitted: list[str] = []
        self.migrations: list[tuple] = []

    def switching(self):
        return {a: to for a, to, *_ in self.started}

    def begin_flip(self, address, to_role, drain_timeout_s, done, migrate=False):
        self.started.append((address, to_role, done, migrate))

    def migrate(self, address, count, reason, done):
        self.migrations.append((address, count, done))

    def readmit(self, address, reason):
        self.readmitted.append(address)
        return "decode"


@pytest.mark.parametrize("migrate", [True, False])
def test_the_simulator_ticks_the_live_controller_through_its_connector(migrate):
    """The same `Controller` ticks the live cluster and the simulated one; fed the same
    signals through the two connectors, it makes the same decisions (a decode worker's flip
    moving its running requests, or not, alike), and after a flip that fails (a drain past its
    deadline) both sit the worker out and re-admit it at the same tick."""
    roles = {"w0": "prefill", "w1": "prefill", "w2": "decode", "w3": "decode", "w4": "decode"}
    now = [0.0]
    live_ws = WorkerSet([a for a, r in roles.items() if r == "prefill"],
                        [a for a, r in roles.items() if r == "decode"],
                        prefill_policy=make_policy("least_loaded"),
                        decode_policy=make_policy("free_kv"), stats_interval_s=0,
                        clock=lambda: now[0])
    live_signals = RequestSignals()
    live_conn = _LiveConnector(RouterControlServicer(live_ws, live_signals,
                                                     clock=lambda: now[0]))
    cfg = dict(cooldown_s=5.0, failed_readmit_s=6.0, migrate=migrate)
    live = Controller(ControllerConfig(router_address="live", **cfg), live_conn,
                      clock=lambda: now[0], slo=Slo(2.0, 0.2))
    sim_router = SimRouter(SimConfig(prefill_workers=2, decode_workers=3), roles)
    cluster = _SimCluster(sim_router, now)
    sim_conn = control.SimConnector(cluster)
    sim = Controller(ControllerConfig(router_address="simulated", **cfg), sim_conn,
                     clock=lambda: now[0], policy_cfg=PolicyConfig(cooldown_s=5.0),
                     slo=Slo(2.0, 0.2))
    rng = random.Random(2)
    actions, failed = [], 0
    try:
        for tick in range(1, 60):
            now[0] = float(tick)
            for a, role in roles.items():
                stats = _stats(rng, role)
                stats.busy_seconds = float(tick)
                stats.prompt_tokens_computed = tick * rng.randrange(500, 1500)
                stats.decode_steps = tick * 20
                stats.decode_step_seconds = tick * 0.5
                live_ws.report(a, stats, now=now[0], asked_s=now[0])
                sim_router.report(a, role, stats, now[0])
            for _ in range(rng.randrange(4)):
                # First tokens slow in two stretches: prefill pressure builds, then ends.
                ttft = 6.0 if 12 <= tick < 26 or 36 <= tick < 48 else 0.3
                e2e, out = ttft + rng.uniform(0.5, 3.0), rng.randrange(2, 64)
                # Each runs to its max_tokens, as a trace's request does in the simulator.
                live_signals.started()
                live_signals.expect_output(out)
                live_signals.finished(Sample(now[0], ttft, (e2e - ttft) / (out - 1), 900, out,
                                             False, 0, "length", max_tokens=out))
                sim_conn.started(out)
                sim_conn.finished(now[0], e2e, ttft, 900, out, False)
            d_live, d_sim = live.tick(), sim.tick()
            assert (d_sim.action, d_sim.flips, d_sim.budgets, d_sim.reason) == (
                d_live.action, d_live.flips, d_live.budgets, d_live.reason), f"tick {tick}"
            assert [(s[0], s[1], s[3]) for s in cluster.started] == [
                (s[0], s[1], s[3]) for s in live_conn.started]
            assert all(s[3] == migrate for s in cluster.started)
            assert cluster.readmitted == live_conn.readmitted, f"tick {tick}"
            actions.append(d_sim.action)
            # The flips end a tick later: the first fails (drain timeout), the rest switch.
            for side in (live_conn, cluster):
                for address, to_role, done, _ in side.started:
                    frm = "decode" if to_role == "prefill" else "prefill"
                    ok = failed > 0
                    done(FlipOutcome(address, frm, to_role, ok, 1.0,
                                     "" if ok else "drain_timeout_s"))
                side.started.clear()
            failed += bool([a for a in actions if "flip" in a])
        assert live.failed_at == sim.failed_at
        assert {a: r.ok for a, r in live.flips.items()} == {a: r.ok for a, r in sim.flips.items()}
    finally:
        live_ws.close()
    assert any("flip" in a for a in actions)  # the scenario reaches flips, not only holds
    assert live_conn.readmitted  # and a failed flip's worker came back


def test_kv_aware_choices_match_the_live_worker_set_with_cached_prefixes():
    """The block index holds prefixes on some workers and in the store; KV-aware routing
    weighs them the same way live and in the simulator."""
    from pdserve.core.block_hash import prompt_block_hashes
    from pdserve.router.kv_feed import KvFeeds
    from pdserve.router.kv_index import STORED, KvEvent
    from pdserve.sim.router import MODEL_ID, STORE

    prefill = ["p0", "p1", "p2", "p3"]
    roles = {**{a: "prefill" for a in prefill}, "d0": "decode"}
    feeds = KvFeeds()  # never started: the test feeds its index, as the streams would
    live = WorkerSet(prefill, ["d0"], prefill_policy=make_policy("kv_aware", seed=5),
                     decode_policy=make_policy("free_kv", seed=6), block_size_tokens=16,
                     feeds=feeds, stats_interval_s=0)
    for a in roles:
        feeds.block_sizes[a] = 16
        feeds.model_ids[a] = MODEL_ID
    sim = SimRouter(SimConfig(prefill_workers=4, decode_workers=1, prefill_policy="kv_aware",
                              seed=5), roles)
    rng = random.Random(3)
    systems = [[s] * 160 + list(range(s * 1000, s * 1000 + 200)) for s in range(1, 5)]
    held, chosen, reused = [], set(), 0
    try:
        for step in range(120):
            prompt = rng.choice(systems)[:rng.randrange(40, 360)] + [rng.randrange(10**6)] * 20
            hashes = prompt_block_hashes(prompt[:-1], 16)
            if rng.random() < 0.4:  # some worker, or the store, caches a prefix of it
                source = rng.choice(prefill + [STORE])
                event = KvEvent(source, STORED, tuple(hashes[:rng.randrange(len(hashes) + 1)]))
                feeds.index.apply(event)
                sim.index.apply(event)
            ctx = live.pick("prefill", prompt)
            live_address, _ = ctx.__enter__()
            address, tokens = sim.pick("prefill", len(prompt), 0, hashes)
            assert address == live_address, f"step {step}"
            # The simulator scores only the candidates that can win (workers caching some of
            # the prompt and the least loaded of the rest); each score is the live one.
            live_scores = {x.index: x for x in live.last_decision.scores}
            assert sim.last_decision.scores
            assert all(live_scores[x.index] == x for x in sim.last_decision.scores)
            assert sim.last_decision.work_tokens == live.last_decision.work_tokens
            held.append((ctx, address, tokens))
            chosen.add(address)
            reused += any(x.local_blocks or x.fetch_blocks for x in sim.last_decision.scores)
            if rng.random() < 0.5:
                ctx, address, tokens = held.pop(rng.randrange(len(held)))
                ctx.__exit__(None, None, None)
                sim.release(address, tokens)
        assert len(chosen) > 1
        assert reused > 20  # the cached prefixes counted in many of the choices
    finally:
        live.close()


def test_conditional_disaggregation_choices_match_the_live_worker_set():
    """Decode workers cache prefixes of the prompts (and report their batches and free
    blocks); the choice of a decode worker to prefill a short uncached tail itself, and what
    it is counted for, are the same live and in the simulator."""
    from pdserve.core.block_hash import prompt_block_hashes
    from pdserve.router.kv_feed import KvFeeds
    from pdserve.router.kv_index import STORED, KvEvent
    from pdserve.sim.router import MODEL_ID

    decode = ["d0", "d1", "d2", "d3"]
    roles = {"p0": "prefill", **{a: "decode" for a in decode}}
    feeds = KvFeeds()  # never started: the test feeds its index, as the streams would
    live = WorkerSet(["p0"], decode, prefill_policy=make_policy("kv_aware", seed=5),
                     decode_policy=make_policy("free_kv", seed=6), block_size_tokens=16,
                     feeds=feeds, stats_interval_s=0)
    for a in roles:
        feeds.block_sizes[a] = 16
        feeds.model_ids[a] = MODEL_ID
    sim = SimRouter(SimConfig(prefill_workers=1, decode_workers=4, seed=5), roles)
    rng = random.Random(4)
    convs = [list(range(s * 1000, s * 1000 + 400)) for s in range(1, 5)]
    held, local = [], 0
    try:
        for step in range(150):
            prompt = rng.choice(convs)[:rng.randrange(17, 400)]
            hashes = prompt_block_hashes(prompt[:-1], 16)
            if rng.random() < 0.5:  # a decode worker caches a prefix of it
                event = KvEvent(rng.choice(decode), STORED,
                                tuple(hashes[:rng.randrange(len(hashes) + 1)]))
                feeds.index.apply(event)
                sim.index.apply(event)
            if rng.random() < 0.3:
                a = rng.choice(decode)
                stats = _stats(rng, "decode")
                live.report(a, stats, now=0.0, asked_s=0.0)
                sim.report(a, "decode", stats, 0.0)
            out, limit = rng.randrange(1, 300), rng.choice((0, 16, 64, 200))
            chosen = live.take_cached_local(LiveRequest(prompt, "", out), limit)
            cached = {a: n for a in decode if (n := sim.index.overlap(a, hashes))}
            got = sim.cached_local(cached, len(prompt), out, limit)
            if chosen is None:
                assert got is None, f"step {step}"
                continue
            address, taken, _ = chosen
            assert got == (address, taken[0]), f"step {step}"
            local += 1
            held.append((address, taken))
            if rng.random() < 0.6:
                address, taken = held.pop(rng.randrange(len(held)))
                live.release_taken(address, taken)
                sim.release(address, taken[0])
            live_members = {m.address: (m.in_flight, m.in_flight_tokens) for m in live.members()}
            assert live_members == {m.address: (m.in_flight, m.in_flight_tokens)
                                    for m in sim.members()}
        assert local > 15
    finally:
        live.close()
