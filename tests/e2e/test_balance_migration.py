"""Running decodes moved off a decode worker that keeps its role (the worker's `Migrate`, the
controller's balance), with real processes on loopback (tiny Llama, a cluster of its own each).

- `Migrate` names the field it refuses (`count`, `reason`), refuses a prefill worker, and moves
  nothing, safely, where nothing runs.
- Under load (1 prefill + 2 decode workers, greedy and seeded-sampled streams mid-answer), the
  busier decode worker moves some of its decodes: each ends with exactly the tokens of a
  fault-free run, the worker counts the moves as "balance" and stays a decode worker, and the
  other worker finished them from the blocks put to the store.
- The worker that takes the moved decodes is killed with SIGKILL as they start there (1 prefill
  + 3 decode workers): the router resumes them on the third, which recomputes what the dead one
  made; no request is lost and no token changes.
- With speculative decoding (the n-gram drafter) on the decode workers, decodes moved mid-answer
  go on speculating where they land; the greedy tokens are those of a run without speculation.
- The controller evens decode load out by itself: one decode worker runs every stream, the
  other joins empty; the controller's tick moves running decodes onto it (the `Migrate` call,
  counted as "balance", audited with the policy's reason), every token unchanged.
- The operator flips the last decode worker to prefill (the controller's SetRole, the call
  `pdserve ctl set-role` makes): with no decode worker left to take them, its running decodes
  finish in place (a `Migrate` meanwhile is refused), every token correct.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdserve import rpc
from pdserve.controller.flip import Flipper
from pdserve.core.identity import CONTROLLER, WORKER
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.launcher.local import LocalCluster
from pdserve.proto import common_pb2
from pdserve.proto import controller_pb2 as cpb
from pdserve.proto import controller_pb2_grpc as cpb_grpc
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats, workers
from tests.e2e.test_controller import start_controller
from tests.e2e.test_live_migration import metric, streaming
from tests.e2e.test_membership import control, wait_for
from tests.e2e.test_migration import Stream, child, retries_metric
from tests.helpers import stop_process

N = 12
MAX_TOKENS = 96
MOVE_AFTER_TOKENS = 12  # every stream has this many when its decode moves: mid-answer
COUNT = 3  # decodes the busier worker moves
BLOCK = 16  # the tiny model's block size (cluster_spec's default)
PROMPTS = [list(range(300 + 17 * i, 300 + 17 * i + 20 + 3 * i)) for i in range(N)]
SAMPLING = [dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0) if i % 2 == 0 else
            dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, top_p=0.9,
                 seed=7000 + i, presence_penalty=0.3) for i in range(N)]
GREEDY = range(0, N, 2)


def fresh(tiny_llama_dir, decode_workers: int = 2, **overrides) -> LocalCluster:
    return LocalCluster(cluster_spec(tiny_llama_dir, prefill_workers=1,
                                     decode_workers=decode_workers, num_blocks=1024,
                                     router_settings={"stats_interval_s": 0.2}, **overrides))


def migrate(address: str, count: int, reason: str = "balance") -> wpb.MigrateResponse:
    with rpc.make_channel(address, WORKER) as ch:
        return wpb_grpc.WorkerStub(ch).Migrate(wpb.MigrateRequest(count=count, reason=reason),
                                               timeout=60)


def start_streams(cluster, indices, busiest: int = COUNT + 1, sampling=SAMPLING
                  ) -> tuple[list[Stream], dict[str, int]]:
    """Streams of these requests, once each has MOVE_AFTER_TOKENS tokens and the busiest decode
    worker runs at least `busiest` (the router may leave a worker without any: requests
    arriving together are placed before the next load report); and how many each decode
    worker runs then."""
    decode = cluster.worker_addresses("decode")
    streams = [Stream(cluster.router_address, i, PROMPTS[i], sampling[i]) for i in indices]
    for s in streams:
        s.start()

    return streams, streaming(streams, decode, lambda n: max(n.values()) >= busiest,
                              f"the busiest decode worker running at least {busiest}")


def fault_free(cluster, indices, sampling=SAMPLING) -> dict[int, list[int]]:
    """Each request's tokens, run concurrently on `cluster` with nothing moved."""
    with ThreadPoolExecutor(len(indices)) as pool:
        outs = pool.map(lambda i: generate(cluster.router_address, token_ids=PROMPTS[i],
                                           **sampling[i])[0], indices)
        return dict(zip(indices, outs))


def assert_tokens(streams: list[Stream], want: dict[int, list[int]]) -> None:
    for s in streams:
        s.join(timeout=240)
        assert not s.is_alive(), f"request {s.i} hangs"
        assert s.error is None, f"request {s.i}: {s.error}"
    for s in streams:
        assert s.finish == common_pb2.FINISH_REASON_LENGTH, f"request {s.i}: {s.finish}"
        assert s.ids == want[s.i], f"request {s.i}: tokens differ from the fault-free run"


def test_migrate_names_the_field_it_refuses_and_moves_nothing_where_nothing_runs(tiny_cluster):
    [prefill], [decode] = workers(tiny_cluster, "prefill"), workers(tiny_cluster, "decode")
    for address, count, reason, code, says in (
            (decode, 0, "balance", grpc.StatusCode.INVALID_ARGUMENT, "count"),
            (decode, -3, "balance", grpc.StatusCode.INVALID_ARGUMENT, "count"),
            (decode, 1, "drain", grpc.StatusCode.INVALID_ARGUMENT, "reason"),
            (decode, 1, "", grpc.StatusCode.INVALID_ARGUMENT, "reason"),
            (prefill, 1, "balance", grpc.StatusCode.FAILED_PRECONDITION, "prefill role")):
        with pytest.raises(grpc.RpcError) as e:
            migrate(address, count, reason)
        assert e.value.code() == code and says in e.value.details(), e.value.details()
    before = worker_stats(decode)
    assert migrate(decode, 5) == wpb.MigrateResponse(moved_requests=0, copied_requests=0)
    after = worker_stats(decode)
    assert after.role == wpb.ROLE_DECODE and after.role_switches == before.role_switches
    assert after.migrations == before.migrations
    ids, _, finish, _ = generate(tiny_cluster.router_address, token_ids=PROMPTS[0], max_tokens=8,
                                 ignore_eos=True)
    assert len(ids) == 8 and finish == common_pb2.FINISH_REASON_LENGTH  # it serves on


@pytest.mark.scenario  # a cluster of its own, under load: with the long scenarios
def test_migrate_under_load_moves_decodes_with_their_kv_and_changes_no_token(tiny_llama_dir):
    with fresh(tiny_llama_dir) as cluster:
        decode = cluster.worker_addresses("decode")
        resumes = retries_metric(cluster, "resume")
        stalls = metric(cluster, "pdserve:migration_stall_seconds_count")
        streams, counts = start_streams(cluster, range(N))
        source = max(counts, key=counts.get)
        [target] = [a for a in decode if a != source]
        assert counts[source] > COUNT  # some move, the rest stay
        before_src, before_dst = worker_stats(source), worker_stats(target)
        flipper = Flipper(move=lambda *a: None)  # the controller's call
        try:
            out = flipper.migrate(source, COUNT, "balance", timeout_s=60)
        finally:
            flipper.close()
        assert out.error == "" and out.moved == COUNT, out
        for s in streams:
            s.join(timeout=240)
        after_src, after_dst = worker_stats(source), worker_stats(target)
        # Moves, not failures: no resume counted, each client's gap timed.
        assert retries_metric(cluster, "resume") == resumes
        assert metric(cluster, "pdserve:migration_stall_seconds_count") - stalls == COUNT
        assert_tokens(streams, fault_free(cluster, range(N)))  # the same, nothing moved
    # Counted as a balance move, every block copied; the worker kept its role.
    delta = {k: after_src.migrations[k] - before_src.migrations[k] for k in after_src.migrations}
    assert delta["balance/copied"] == COUNT and sum(delta.values()) == COUNT, delta
    assert after_src.role == wpb.ROLE_DECODE
    assert after_src.role_switches == before_src.role_switches
    assert after_src.migration_bytes > before_src.migration_bytes
    # The other worker finished them: it resumed each from the store's blocks, computing only
    # its last partial block, not its prompt and every token it had made.
    assert after_dst.local_prefill_requests - before_dst.local_prefill_requests == COUNT
    computed = after_dst.resumed_tokens_computed - before_dst.resumed_tokens_computed
    assert 0 < computed <= COUNT * BLOCK, computed
    assert after_dst.kv_blocks_fetched - before_dst.kv_blocks_fetched >= COUNT


# Answers four times as long: the moved decodes must still run when the move and the kill come,
# however fast the host decodes the rest.
LONG = [dict(s, max_tokens=4 * MAX_TOKENS) for s in SAMPLING]


@pytest.mark.scenario  # a cluster of its own, SIGKILL under load: with the long scenarios
def test_a_target_killed_as_moved_decodes_start_there_loses_no_request(tiny_llama_dir):
    with fresh(tiny_llama_dir, decode_workers=3) as cluster:
        decode = cluster.worker_addresses("decode")
        resumes = retries_metric(cluster, "resume")
        streams, counts = start_streams(cluster, range(N), sampling=LONG)
        source = max(counts, key=counts.get)
        channels = {a: rpc.make_channel(a, WORKER) for a in decode if a != source}
        stubs = {a: wpb_grpc.WorkerStub(ch) for a, ch in channels.items()}

        def resumed_here() -> dict[str, int]:  # moved decodes each worker started
            return {a: s.GetStats(wpb.GetStatsRequest(), timeout=10).local_prefill_requests
                    for a, s in stubs.items()}

        before = resumed_here()
        out: dict = {}

        def move() -> None:
            try:
                out["r"] = migrate(source, COUNT)
            except BaseException as e:  # noqa: BLE001 - reported below
                out["error"] = e

        mover = threading.Thread(target=move, daemon=True)
        mover.start()
        try:
            # The first worker a moved decode starts on dies before they all run there.
            def started() -> str | dict | None:  # where one started, or how the move ended
                ended = dict(out)  # read first: a move that ended had started its decodes
                return next((a for a, n in resumed_here().items() if n > before[a]),
                            None) or ended

            victim = wait_for("a moved decode started on another worker, or the move ended",
                              started, 60)
            if not isinstance(victim, str) and victim.get("r") is not None:
                # The move ended as its target took the decodes; the target counts one as
                # started at its first step, which can come a moment later.
                victim = wait_for("a moved decode started on another worker", lambda: next(
                    (a for a, n in resumed_here().items() if n > before[a]), None), 15)
            assert isinstance(victim, str), f"no moved decode started elsewhere: {victim}"
            child(cluster, victim).proc.kill()
        finally:
            for ch in channels.values():
                ch.close()
        mover.join(timeout=60)
        assert out.get("r") is not None and out["r"].moved_requests == COUNT, out
        for s in streams:
            s.join(timeout=240)
        # The victim's decodes, moved ones included, resumed on a worker left: by recompute
        # from what the store holds.
        assert retries_metric(cluster, "resume") - resumes >= 1
        assert_tokens(streams, fault_free(cluster, range(N), LONG))


def without_speculation(model_path: str, indices) -> dict[int, list[int]]:
    """Greedy tokens of these requests from the engine alone, in one process, drafting none."""
    engine = LLMEngine(EngineConfig(model_path, cache=CacheConfig(block_size_tokens=BLOCK,
                                                                  num_blocks=512)))
    outs = engine.generate([PROMPTS[i] for i in indices],
                           SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    return dict(zip(indices, outs))


@pytest.mark.scenario  # a cluster of its own: with the long scenarios
def test_decodes_moved_while_speculating_change_no_greedy_token(tiny_llama_dir):
    want = without_speculation(tiny_llama_dir, GREEDY)
    with fresh(tiny_llama_dir, spec_method="ngram", spec_schedule=False) as cluster:
        decode = cluster.worker_addresses("decode")
        streams, counts = start_streams(cluster, GREEDY, busiest=1)
        source = max(counts, key=counts.get)
        [target] = [a for a in decode if a != source]
        before = worker_stats(target)
        # More than it runs: it moves every decode it runs, and no more.
        r = migrate(source, 10 * N)
        assert 0 < r.moved_requests == r.copied_requests <= counts[source], r
        assert worker_stats(source).num_running == 0
        for s in streams:
            s.join(timeout=240)
        after = worker_stats(target)
    assert_tokens(streams, want)
    assert after.local_prefill_requests - before.local_prefill_requests == r.moved_requests
    # The target drafted on after taking them, and the drafts it kept changed no token.
    assert after.spec_decode_num_drafts > before.spec_decode_num_drafts
    assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens


@pytest.mark.scenario  # a cluster of its own and a controller: with the long scenarios
def test_the_last_decode_worker_flipped_by_the_operator_finishes_its_decodes_in_place(
        tiny_llama_dir, tmp_path):
    requests = range(4)
    # Longer answers: the drain starts while each has most of its tokens to make.
    long = {i: dict(SAMPLING[i], max_tokens=2 * MAX_TOKENS) for i in requests}
    spec = cluster_spec(tiny_llama_dir, prefill_workers=1, decode_workers=1, num_blocks=1024,
                        router_settings={"stats_interval_s": 0.2})
    with LocalCluster(spec) as cluster:
        [decode] = cluster.worker_addresses("decode")
        # Before the flip: after it no decode worker is left to serve a request.
        want = fault_free(cluster, requests, long)
        proc, address, _ = start_controller(cluster, tmp_path, "--mode", "advisory")
        try:
            streams = [Stream(cluster.router_address, i, PROMPTS[i], long[i])
                       for i in requests]
            for s in streams:
                s.start()
            wait_for("every request streaming", lambda: all(
                len(s.ids) >= MOVE_AFTER_TOKENS for s in streams), 120)
            out: dict = {}

            def flip() -> None:  # the operator's, through the controller's API
                with rpc.make_channel(address, CONTROLLER) as ch:
                    out["r"] = cpb_grpc.ControllerStub(ch).SetRole(
                        cpb.ControllerSetRoleRequest(address=decode, role=wpb.ROLE_PREFILL,
                                                     drain_timeout_s=240), timeout=300)

            flipper = threading.Thread(target=flip, daemon=True)
            flipper.start()
            wait_for("the decode worker draining", lambda: worker_stats(decode).draining, 60)
            # A balance call meanwhile is refused: the drain decides what becomes of them.
            with pytest.raises(grpc.RpcError) as e:
                migrate(decode, 1)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "draining" in e.value.details()
            flipper.join(timeout=300)
        finally:
            assert stop_process(proc, timeout_s=15) == 0
        r = out["r"]
        assert r.ok, r.error
        assert r.drained_requests == len(requests)  # each finished in place, none moved
        stats = worker_stats(decode)
        assert stats.role == wpb.ROLE_PREFILL and not any(stats.migrations.values())
        for s in streams:
            s.join(timeout=240)
        assert_tokens(streams, want)


@pytest.mark.scenario  # a cluster of its own and a controller: with the long scenarios
def test_the_controller_moves_decodes_off_the_loaded_worker_onto_an_idle_one(tiny_llama_dir,
                                                                             tmp_path):
    with fresh(tiny_llama_dir) as cluster:
        want = fault_free(cluster, range(N))
        busy, idle = cluster.worker_addresses("decode")
        ctl = control(cluster.router_control_address)
        # Every stream starts on one decode worker: the other is out of the pool meanwhile.
        ctl.SetWorkerState(rpb.SetWorkerStateRequest(
            address=idle, state=rpb.MEMBER_STATE_DRAINING, reason="test: empty"), timeout=10)
        streams = [Stream(cluster.router_address, i, PROMPTS[i], SAMPLING[i]) for i in range(N)]
        for s in streams:
            s.start()
        wait_for("every request streaming", lambda: all(
            len(s.ids) >= MOVE_AFTER_TOKENS for s in streams), 120)
        before = worker_stats(busy)
        assert before.num_running == N
        ctl.SetWorkerState(rpb.SetWorkerStateRequest(
            address=idle, state=rpb.MEMBER_STATE_ACTIVE, role=wpb.ROLE_DECODE), timeout=10)
        # No flips, no offload: the only action left is the move. An ITL SLO every step of
        # the busy worker misses, and the shipped CPU profile's shape for the step model.
        proc, _, audit = start_controller(
            cluster, tmp_path, "--fluid-role", "false", "--fluid-token", "false",
            "--itl-slo-ms", "5", "--step-profile", "cpu-smollm2-135m")
        try:
            moved = wait_for("the controller moved decodes", lambda: next(
                (e for e in audit_events(audit) if e["event"] == "migrate"), None), 60)
        finally:
            assert stop_process(proc, timeout_s=15) == 0
        assert moved["address"] == busy and moved["error"] == "" and moved["moved"] >= 1
        assert "projected step" in moved["reason"]
        after = worker_stats(busy)
        assert after.role == wpb.ROLE_DECODE
        assert (after.migrations["balance/copied"] + after.migrations["balance/partial"]
                - before.migrations["balance/copied"] - before.migrations["balance/partial"]
                ) >= moved["moved"]
        assert_tokens(streams, want)


def audit_events(path) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []
