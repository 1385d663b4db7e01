"""Cores shared between the workers of one host: the decisions, the shared ledger, the engine
loop, and both ways of sharing (turns on all the cores; lending idle ones).

The ledger is a real file shared with real child processes (the other workers of the host); the
engine loop test runs a real tiny engine. Thread counts are recorded through the `apply` hook,
the one the worker points at `torch.set_num_threads`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.worker.config import WorkerConfig
from pdserve.core.errors import ConfigError
from pdserve.worker.cores import (TURN_STEP_TOKENS, CoreLedger, StepThreads, gives_back,
                                  must_wait, step_threads, takes_up, turn_waits, yields)
from pdserve.worker.engine_loop import EngineLoop


def test_a_step_takes_its_own_share_plus_what_the_others_leave_idle():
    assert step_threads(own=1, most=2, cores=2, others=0) == 2  # the other worker idles
    assert step_threads(own=1, most=2, cores=2, others=1) == 1
    assert step_threads(own=1, most=4, cores=4, others=1) == 3
    assert step_threads(own=1, most=2, cores=8, others=0) == 2  # never past its own cap
    # Never under its own share, even when the others' shares already fill the host.
    assert step_threads(own=1, most=2, cores=2, others=3) == 1
    assert step_threads(own=2, most=2, cores=2, others=2) == 2


def test_a_newcomer_waits_only_for_a_borrowed_step_that_would_oversubscribe():
    assert must_wait(own=1, cores=2, others=[(2, 1)])  # the other borrowed this core
    assert not must_wait(own=1, cores=2, others=[(1, 1)])  # the other keeps to its share
    assert not must_wait(own=1, cores=2, others=[])
    assert not must_wait(own=1, cores=4, others=[(2, 1)])  # a core is still idle
    # Four one-thread workers on 2 cores never wait for each other: none of them borrows.
    assert not must_wait(own=1, cores=2, others=[(1, 1), (1, 1), (1, 1)])


def test_a_borrowing_step_gives_back_only_what_oversubscribes_the_host():
    assert gives_back(current=2, own=1, cores=2, others=1)  # the lender claimed its share
    assert not gives_back(current=2, own=1, cores=2, others=0)  # the lender still idles
    assert not gives_back(current=1, own=1, cores=2, others=1)  # on its own share already
    assert not gives_back(current=1, own=1, cores=2, others=2)  # not borrowing: never
    assert not gives_back(current=3, own=1, cores=4, others=1)  # a core is still idle
    assert gives_back(current=3, own=1, cores=4, others=2)


def test_a_worker_yields_only_to_more_prompts_waiting_for_a_first_token_than_it_holds():
    assert yields(held=2, their_fresh=30)  # a few decoding requests before a wave of prompts
    assert not yields(held=15, their_fresh=2)  # a decode batch keeps its share beside a prompt
    assert not yields(held=2, their_fresh=2)  # a tie: each keeps its share
    assert not yields(held=3, their_fresh=0)  # nobody yields to requests that have a token
    assert not yields(held=0, their_fresh=0)


def test_a_step_takes_up_idle_cores_only_when_every_worker_holding_requests_yields():
    assert takes_up(current=1, most=2, cores=2, others=0, fresh=30, their_held=[2]) == 2
    assert takes_up(current=1, most=2, cores=2, others=0, fresh=2, their_held=[15]) == 1
    assert takes_up(current=1, most=2, cores=2, others=1, fresh=30, their_held=[2]) == 1
    assert takes_up(current=2, most=2, cores=2, others=0, fresh=30, their_held=[]) == 2
    assert takes_up(current=1, most=2, cores=2, others=0, fresh=1, their_held=[0, 0]) == 2
    assert takes_up(current=1, most=4, cores=4, others=1, fresh=30, their_held=[2]) == 3
    assert takes_up(current=1, most=2, cores=2, others=0, fresh=5, their_held=[2, 9]) == 1


def others(ledger: CoreLedger) -> list[tuple[int, int]]:
    """(threads in use, own share) of the other workers' steps in progress, as `ledger` sees."""
    return [(n, own) for _, n, own in ledger.steps()]


HOLDER = textwrap.dedent("""
    import sys, time
    from pdserve.worker.cores import CoreLedger
    led = CoreLedger(sys.argv[1])
    waiting = int(sys.argv[2]) < 0  # waits for a turn since now instead
    claim_waits = len(sys.argv) > 4  # a lender's claim while it waits for a borrowed step
    led.set(0 if waiting else int(sys.argv[2]), int(sys.argv[3]),
            time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
            if waiting or claim_waits else 0)
    print("claimed", flush=True)
    for line in sys.stdin:  # until the test closes its stdin or kills it
        if line.strip() == "release":
            led.set(0, 0)
            print("released", flush=True)
""")


def holder(path, threads: int, own: int, claim_waits: bool = False) -> subprocess.Popen:
    """Another worker of the host, in its own process, inside a step on `threads` threads (its
    share `own`; -1: waiting for a turn; `claim_waits`: a lender's claim of its share while it
    waits for a borrowed step) until told "release"."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), str(threads), str(own),
                          *(["waits"] if claim_waits else [])],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "claimed"
    return p


def release_after(p: subprocess.Popen, delay_s: float) -> threading.Timer:
    """End the holder's step `delay_s` from now, while the test thread waits in `begin()`."""
    def release():
        p.stdin.write("release\n")
        p.stdin.flush()

    t = threading.Timer(delay_s, release)
    t.start()
    return t


def test_the_ledger_shows_other_processes_steps_and_forgets_a_dead_one(tmp_path):
    path = tmp_path / "cores"
    me = CoreLedger(str(path))
    other = holder(path, 2, 1)
    try:
        assert others(me) == [(2, 1)]
        me.set(1, 1)  # my own claim is not among the others
        assert others(me) == [(2, 1)]
    finally:
        other.kill()
        other.wait()
    assert others(me) == []  # its claim stays written, but its pid is gone
    again = CoreLedger(str(path))  # a restarted worker takes the dead one's slot
    assert (me.slot, again.slot) == (0, 1)
    again.set(1, 1)
    assert others(me) == [(1, 1)]
    again.close()
    assert others(me) == []
    me.close()


@pytest.mark.parametrize("turns, held", [(False, 2), (True, 1)], ids=["lend", "turns"])
def test_a_newcomer_waits_for_the_step_in_its_way_then_takes_both_cores(tmp_path, turns, held):
    # Lending: a borrowed step (2 threads) is in its way. Turns: any step, even on its share.
    path = tmp_path / "cores"
    applied: list[int] = []
    st = StepThreads(CoreLedger(str(path)), own=1, most=2, cores=2, apply=applied.append,
                     max_wait_s=30.0, turns=turns)
    other = holder(path, held, 1)  # the other worker's step, ended 0.3 s from now
    release_after(other, 0.3)
    try:
        peer = CoreLedger(str(path))  # what the other reads before its next step
        t0 = time.monotonic()
        n = st.begin()
        waited = time.monotonic() - t0
        assert other.stdout.readline().strip() == "released"
        assert waited >= 0.2, "started while the other's step was in its way"
        assert st.waited_s >= 0.2
        assert n == 2 and applied == [2]  # once the other idles, both cores are this step's
        seen = dict(others(peer))
        assert seen == {2: 1}  # the other sees this step's claim (2 threads, share 1)
        st.end()
        assert others(peer) == []
        peer.close()
    finally:
        other.kill()
        other.wait()


def test_each_way_of_sharing_has_its_own_wait_bound(tmp_path):
    path = str(tmp_path / "cores")
    assert StepThreads(CoreLedger(path), 1, 2, 2, lambda n: None).max_wait_s == 0.2
    assert StepThreads(CoreLedger(path), 1, 2, 2, lambda n: None, turns=True).max_wait_s == 2.0


def test_a_newcomer_waits_at_most_its_bound(tmp_path):
    path = tmp_path / "cores"
    st = StepThreads(CoreLedger(str(path)), own=1, most=2, cores=2, apply=lambda n: None,
                     max_wait_s=0.1)
    other = holder(path, 2, 1)  # a borrower that never ends its step
    try:
        t0 = time.monotonic()
        assert st.begin() == 1  # past the bound it steps on its own share
        assert time.monotonic() - t0 < 10
        assert st.borrowed_steps == 0
    finally:
        other.kill()
        other.wait()


def test_the_engine_loop_steps_on_lent_cores_only_while_the_other_worker_idles(
        tmp_path, tiny_llama_dir):
    path = tmp_path / "cores"
    applied: list[int] = []
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(block_size_tokens=4,
                                                                        num_blocks=64)))
    threads = StepThreads(CoreLedger(str(path)), own=1, most=2, cores=2,
                          apply=applied.append)
    loop = EngineLoop(engine, threads=threads).start()
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    def generate(rid: str) -> int:
        def add():
            stream = loop.open_stream(rid)
            loop.engine.add_request(rid, [3, 4, 5, 6, 7, 8], params)
            return stream

        stream, n = loop.call(add), 0
        while True:
            item = stream.get(timeout=60)
            assert item.error is None
            n += 1
            if item.output.finished:
                return n

    try:
        assert generate("alone") == 6
        assert applied == [2] and threads.borrowed_steps == loop.steps
        other = holder(path, 1, 1)  # the other worker computes on its share
        try:
            steps = loop.steps
            assert generate("beside") == 6
            assert applied == [2, 1]
            assert threads.borrowed_steps == steps  # none borrowed beside it
        finally:
            other.kill()
            other.wait()
        assert generate("alone again") == 6
        assert applied == [2, 1, 2]
    finally:
        loop.stop()
    assert others(CoreLedger(str(path))) == []  # every step released its claim


BORROWER = textwrap.dedent("""
    import sys, time
    from pdserve.worker.cores import CoreLedger, StepThreads
    st = StepThreads(CoreLedger(sys.argv[1]), own=1, most=2, cores=2, apply=lambda n: None)
    print("step on", st.begin(), flush=True)
    while st.current > st.own:  # the step's layers, until its lender claims its core
        time.sleep(0.001)
        st.between_layers()
    print("gave back", st.given_back, flush=True)
    sys.stdin.read()  # the step goes on, on its own share, until the test ends it
""")


def test_a_borrowed_step_keeps_its_cores_through_the_lenders_wait_then_gives_them_back(
        tmp_path):
    path = tmp_path / "cores"
    me = CoreLedger(str(path))  # opened first, so the borrower's step finds both cores idle
    borrower = subprocess.Popen([sys.executable, "-c", BORROWER, str(path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert borrower.stdout.readline().strip() == "step on 2"
        assert others(me) == [(2, 1)]
        # The borrowed step never ends here: the lender waits out its bound, then steps on
        # its own share, and only then does the borrower give its core back.
        st = StepThreads(me, own=1, most=2, cores=2, apply=lambda n: None, max_wait_s=3.0)
        seen_while_waiting: list[list[tuple[int, int]]] = []
        probe = CoreLedger(str(path))  # a third view of the ledger, sampled during the wait
        timer = threading.Timer(0.3, lambda: seen_while_waiting.append(
            [(n, own) for pid, n, own in probe.steps() if pid == borrower.pid]))
        timer.start()
        t0 = time.monotonic()
        assert st.begin() == 1  # beside the borrower, on its own share
        waited = time.monotonic() - t0
        timer.join()
        assert seen_while_waiting == [[(2, 1)]], "gave back before the lender's bound"
        assert waited >= 2.9
        assert borrower.stdout.readline().strip() == "gave back 1"
        assert [(n, own) for pid, n, own in probe.steps() if pid == borrower.pid] == [(1, 1)]
        assert st.borrowed_steps == 0
        st.end()
        probe.close()
    finally:
        borrower.kill()
        borrower.wait()


def test_a_borrowing_step_gives_back_once_and_only_to_a_lender_that_computes(tmp_path):
    path = tmp_path / "cores"
    applied: list[int] = []
    st = StepThreads(CoreLedger(str(path)), own=1, most=2, cores=2, apply=applied.append)
    assert st.begin() == 2
    st.between_layers()
    time.sleep(0.01)
    st.between_layers()
    assert applied == [2] and st.given_back == 0  # nobody claimed: it keeps both cores
    waiting = holder(path, 1, 1, claim_waits=True)  # a lender waiting within its bound
    try:
        time.sleep(0.01)
        st.between_layers()
        assert applied == [2] and st.given_back == 0
    finally:
        waiting.kill()
        waiting.wait()
    lender = holder(path, 1, 1)  # a lender computing beside it
    try:
        time.sleep(0.01)
        st.between_layers()
        assert applied == [2, 1] and st.given_back == 1 and st.current == 1
        time.sleep(0.01)
        st.between_layers()
        assert applied == [2, 1] and st.given_back == 1  # once a step
        st.end()
        assert st.begin() == 1  # the lender still computes: the next step on its share
        assert applied == [2, 1]
        st.end()
    finally:
        lender.kill()
        lender.wait()
    assert st.begin() == 2 and applied == [2, 1, 2]
    st.end()


WAVE = textwrap.dedent("""
    import select, sys, time
    from pdserve.worker.cores import CoreLedger, StepThreads
    st = StepThreads(CoreLedger(sys.argv[1]), own=1, most=2, cores=2, apply=lambda n: None)
    fresh = int(sys.argv[2])  # prompts its engine holds, none with a first token yet
    print("step on", st.begin(fresh, fresh), flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:  # its layers, until told to end
        time.sleep(0.001)
        st.between_layers()
    st.end()
    print("took up", st.taken_up, flush=True)
    sys.stdin.read()
""")


def wave(path, fresh: int) -> subprocess.Popen:
    """A prefill worker in its own process, inside a step on its own share (another worker
    computes beside it as it starts) for `fresh` prompts, looking at the ledger between its
    layers until told to end the step."""
    beside = holder(path, 1, 1)
    try:
        p = subprocess.Popen([sys.executable, "-c", WAVE, str(path), str(fresh)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "step on 1"
    finally:
        beside.kill()
        beside.wait()
    return p


def test_a_few_decodes_yield_their_cores_to_a_wave_of_prompts_and_not_to_one(tmp_path):
    path = tmp_path / "cores"
    me = CoreLedger(str(path))
    probe = CoreLedger(str(path))
    st = StepThreads(me, own=1, most=2, cores=2, apply=lambda n: None)
    prompts = wave(path, fresh=30)
    try:
        # Holding 2 requests, this worker waits for the step of 30 prompts, which takes up
        # the core it leaves idle; once that step ends, it steps on both cores.
        seen: list[list[tuple[int, int]]] = []
        timer = threading.Timer(0.4, lambda: seen.append(
            [(n, own) for pid, n, own in probe.steps() if pid == prompts.pid]))
        ender = threading.Timer(0.8, lambda: (prompts.stdin.write("end\n"),
                                              prompts.stdin.flush()))
        timer.start()
        ender.start()
        t0 = time.monotonic()
        assert st.begin(held=2, fresh=0) == 2
        waited = time.monotonic() - t0
        timer.join()
        ender.join()
        assert seen == [[(2, 1)]], "the wave's step did not take up the yielded core"
        assert prompts.stdout.readline().strip() == "took up 1"
        assert 0.7 <= waited < 2.0
        st.end(2, 0)
    finally:
        prompts.kill()
        prompts.wait()
    prompts = wave(path, fresh=30)
    beside = holder(path, 1, 1)
    try:
        # With another step computing beside the wave's, the host has no core the wave
        # could take up: nothing to yield to, this worker steps on its share at once.
        deadline = time.monotonic() + 10
        while ([(n, own) for pid, n, own in probe.steps() if pid == prompts.pid] != [(1, 1)]
               and time.monotonic() < deadline):  # the wave gave back what it took up
            time.sleep(0.01)
        t0 = time.monotonic()
        assert st.begin(held=2, fresh=0) == 1
        assert time.monotonic() - t0 < 0.1
        st.end(2, 0)
    finally:
        for p in (prompts, beside):
            p.kill()
            p.wait()
    prompt = wave(path, fresh=2)
    try:
        # Holding 15, it does not wait for a step of 2 prompts: it computes on its share
        # beside it, which therefore keeps to its own.
        t0 = time.monotonic()
        assert st.begin(held=15, fresh=0) == 1
        assert time.monotonic() - t0 < 0.1
        time.sleep(0.05)
        assert [(n, own) for pid, n, own in probe.steps() if pid == prompt.pid] == [(1, 1)]
        st.end(15, 0)
        prompt.stdin.write("end\n")
        prompt.stdin.flush()
        assert prompt.stdout.readline().strip() == "took up 0"
    finally:
        prompt.kill()
        prompt.wait()
    probe.close()


def test_the_engine_calls_the_hook_between_every_layer_of_every_step(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(block_size_tokens=4,
                                                                        num_blocks=64)))
    layers = engine.model.cfg.num_hidden_layers
    seen: list[int] = []
    streamed: list[int] = []
    engine.between_layers = seen.append
    engine.on_prefill_layer = lambda li, spans: streamed.append(li)
    engine.add_request("p", [9, 10, 11, 12], SamplingParams(max_tokens=1), prefill_only=True)
    engine.step()
    # The prefill role's layer streaming still runs, before the hook, on its layers.
    assert streamed == list(range(layers)) and seen == list(range(layers))
    engine.abort("p")
    engine.add_request("a", [3, 4, 5, 6, 7, 8],
                       SamplingParams(max_tokens=3, ignore_eos=True))
    steps = 0
    while engine.has_work():
        engine.step()
        steps += 1
    assert steps >= 3 and layers >= 2
    assert seen == list(range(layers)) * (steps + 1)
    assert streamed == list(range(layers))  # a request not prefill-only streams nothing


def test_worker_config_checks_the_lending_fields():
    WorkerConfig(model_path="m", threads=1, core_ledger="/tmp/x", max_threads=2)
    with pytest.raises(ConfigError, match="core_ledger"):
        WorkerConfig(model_path="m", threads=0, core_ledger="/tmp/x")
    with pytest.raises(ConfigError, match="max_threads"):
        WorkerConfig(model_path="m", threads=2, max_threads=1)
    with pytest.raises(ConfigError, match="max_threads"):
        WorkerConfig(model_path="m", threads=1, max_threads=-1)


def test_a_stalled_borrower_costs_one_wait_not_one_per_step(tmp_path):
    path = tmp_path / "cores"
    st = StepThreads(CoreLedger(str(path)), own=1, most=2, cores=2, apply=lambda n: None,
                     max_wait_s=0.3)
    other = holder(path, 2, 1)  # stopped inside a borrowed step
    try:
        t0 = time.monotonic()
        assert st.begin() == 1
        st.end()
        assert time.monotonic() - t0 >= 0.3  # waited its bound once
        t1 = time.monotonic()
        for _ in range(5):
            assert st.begin() == 1  # its share, beside the 2 threads still claimed
            st.end()
        assert time.monotonic() - t1 < 0.3  # and never waited again
    finally:
        other.kill()
        other.wait()
    # A borrower that ends its step and borrows again is waited for again.
    again = holder(path, 2, 1)
    release_after(again, 0.2)
    try:
        t0 = time.monotonic()
        st.begin()
        st.end()
        assert time.monotonic() - t0 >= 0.1
    finally:
        again.kill()
        again.wait()


# ---- turns ----------------------------------------------------------------------------------
def test_a_worker_taking_turns_waits_for_every_step_and_for_earlier_waiters():
    assert not turn_waits(slot=1, since_us=0, computing=0, waiting=[])
    assert turn_waits(slot=1, since_us=0, computing=1, waiting=[])  # even one on its own share
    assert turn_waits(slot=1, since_us=0, computing=0, waiting=[(50, 2)])  # not yet waiting
    assert turn_waits(slot=1, since_us=100, computing=0, waiting=[(50, 2)])  # it came first
    assert not turn_waits(slot=1, since_us=100, computing=0, waiting=[(150, 0)])  # it came after
    assert not turn_waits(slot=1, since_us=100, computing=0, waiting=[(100, 2)])  # a tie: slot
    assert turn_waits(slot=1, since_us=100, computing=0, waiting=[(100, 0)])


def test_turns_go_first_come_first_served(tmp_path):
    path = tmp_path / "cores"
    st = StepThreads(CoreLedger(str(path)), own=1, most=2, cores=2, apply=lambda n: None,
                     turns=True, max_wait_s=30.0)
    other = holder(path, -1, 1)  # it waits for a turn since before this worker's next step
    release_after(other, 0.3)  # ... and gives up its place 0.3 s from now
    try:
        t0 = time.monotonic()
        assert st.begin() == 2
        assert time.monotonic() - t0 >= 0.2, "jumped ahead of a worker waiting before it"
        st.end()
    finally:
        other.kill()
        other.wait()
    # A worker that arrives after this one is waiting does not hold it up.
    me = CoreLedger(str(path))
    me.set(0, 1, 1)  # waiting since the clock's first microsecond: before anyone else
    later = holder(path, -1, 1)
    try:
        assert not turn_waits(me.slot, 1, 0, [(s, i) for s, i, _ in me.turns()[1]])
    finally:
        later.kill()
        later.wait()
        me.close()


def test_a_long_step_is_waited_for_at_each_step_and_a_stopped_one_not_at_all(tmp_path):
    path = tmp_path / "cores"
    st = StepThreads(CoreLedger(str(path)), own=1, most=2, cores=2, apply=lambda n: None,
                     turns=True, max_wait_s=0.2)
    other = holder(path, 2, 1)  # a live worker inside a step that does not end
    try:
        for _ in range(2):  # past the bound it steps on its own share, and waits again next time
            t0 = time.monotonic()
            assert st.begin() == 1
            st.end()
            assert time.monotonic() - t0 >= 0.2
        os.kill(other.pid, signal.SIGSTOP)  # stopped inside its step: it makes no progress
        t0 = time.monotonic()
        for _ in range(5):
            assert st.begin() == 1  # its share, beside the 2 threads still claimed
            st.end()
        assert time.monotonic() - t0 < 0.2
    finally:
        other.kill()
        other.wait()


def test_a_worker_taking_turns_on_cpu_keeps_its_steps_short():
    from pdserve.worker.server import step_token_budget

    turns = WorkerConfig(model_path="m", threads=1, core_ledger="/tmp/x", device="cpu",
                         core_sharing="turns", max_num_batched_tokens=2048)
    assert step_token_budget(turns) == TURN_STEP_TOKENS == 512
    assert step_token_budget(WorkerConfig(model_path="m", threads=1, core_ledger="/tmp/x",
                                          device="cpu", core_sharing="turns",
                                          max_num_batched_tokens=256)) == 256
    for cfg in (WorkerConfig(model_path="m", threads=1, core_ledger="/tmp/x", device="cpu",
                             max_num_batched_tokens=2048),
                WorkerConfig(model_path="m", threads=1, device="cpu", core_sharing="turns",
                             max_num_batched_tokens=2048)):
        assert step_token_budget(cfg) == 2048  # lending (the default), or no ledger: as set


def test_an_unset_step_budget_follows_the_device():
    from pdserve.worker.server import step_token_budget

    # 0 (the default): short steps on a CPU, where batching prompts does not make prefill
    # faster per token; big ones on an accelerator. A value that is set is kept.
    assert WorkerConfig(model_path="m").max_num_batched_tokens == 0
    assert step_token_budget(WorkerConfig(model_path="m", device="cpu")) == 512
    assert step_token_budget(WorkerConfig(model_path="m", device="cuda")) == 2048
    assert step_token_budget(WorkerConfig(model_path="m", device="cpu",
                                          max_num_batched_tokens=4096)) == 4096
    with pytest.raises(ConfigError, match="max_num_batched_tokens"):
        WorkerConfig(model_path="m", max_num_batched_tokens=-1)


def test_core_sharing_names_the_field_when_wrong():
    from pdserve.launcher.cluster_spec import ClusterSpec

    with pytest.raises(ConfigError, match="core_sharing"):
        WorkerConfig(model_path="m", threads=1, core_sharing="share")
    with pytest.raises(ConfigError, match="core_sharing"):
        ClusterSpec(model_path="m", core_sharing="share")


def test_a_controller_over_workers_taking_turns_on_cpu_offloads_no_prefill():
    from pdserve.launcher.cluster_spec import ClusterSpec
    from pdserve.launcher.local import LocalCluster

    def args(**kw):
        spec = ClusterSpec("m.gguf", worker_devices=kw.pop("devices", ("cpu", "cpu")), **kw)
        return LocalCluster(spec)._offload_settings()

    assert args(core_sharing="turns") == {"fluid_token": False}
    assert args() == {}  # lent cores (the default): a decode worker may have idle ones
    assert args(core_sharing="turns", share_cores=False) == {}
    assert args(core_sharing="turns", devices=("cuda:0", "cuda:1")) == {}  # no cores shared
