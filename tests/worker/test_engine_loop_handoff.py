"""The engine loop lets the readers of a step's outputs send them before the next step starts.

A real tiny engine in a real `EngineLoop`; each reader thread "sends" by sleeping after it takes
an output. The loop's hand-off bound is set far above any delay a loaded host adds, so the
order of events, not a duration, is what the tests check.
"""

from __future__ import annotations

import threading
import time

import pytest

from pdserve.core.sampling_params import SamplingParams
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.worker.engine_loop import EngineLoop

PROMPT = [(5 * i + 2) % 400 + 3 for i in range(12)]
TOKENS = 8


@pytest.fixture
def engine(tiny_llama_dir):
    return LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(block_size_tokens=4,
                                                                      num_blocks=64)))


def step_starts(engine) -> list[float]:
    """Installed over `engine.step`: the perf_counter at which each step starts."""
    starts: list[float] = []
    step = engine.step

    def timed():
        starts.append(time.perf_counter())
        return step()

    engine.step = timed
    return starts


def start_request(loop: EngineLoop, rid: str, max_tokens: int = TOKENS):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def add():
        stream = loop.open_stream(rid)
        loop.engine.add_request(rid, PROMPT, params)
        return stream

    return loop.call(add)


def start_requests(loop: EngineLoop, rids: list[str]) -> list:
    """Add several requests in one command, so that their first step serves all of them: a
    request added alone would step, and queue outputs, before the next one's reader exists."""
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)

    def add():
        streams = [loop.open_stream(rid) for rid in rids]
        for rid in rids:
            loop.engine.add_request(rid, PROMPT, params)
        return streams

    return loop.call(add)


def read(stream, send_s: float, log: list) -> None:
    """Take each output, 'send' it for send_s, log (took, back), until the request finishes."""
    while True:
        item = stream.get(timeout=30)
        took = time.perf_counter()
        time.sleep(send_s)
        log.append((took, time.perf_counter()))
        if item.output.finished:
            return


def test_the_next_step_waits_for_the_readers_of_the_last(engine):
    starts = step_starts(engine)
    loop = EngineLoop(engine, handoff_s=30.0).start()
    try:
        logs: list[list] = [[], []]
        # Both in one command: added one by one, the first request's steps ran before the
        # second's add (a command, which ends a hand-off wait) and before any reader existed,
        # so its outputs queued up and its reader later sent a backlog the loop rightly does
        # not wait for.
        streams = start_requests(loop, ["r0", "r1"])
        readers = [threading.Thread(target=read, args=(s, 0.02 * (i + 1), logs[i]))
                   for i, s in enumerate(streams)]
        for r in readers:
            r.start()
        for r in readers:
            r.join(timeout=60)
            assert not r.is_alive()
    finally:
        loop.stop()
    assert all(len(log) >= 2 for log in logs)
    # Every step that started after a reader took an output started after that reader was
    # back: no step ran while a reader was still sending (its last output excepted: a finished
    # request's reader does not come back).
    for log in logs:
        for took, back in log[:-1]:
            assert all(s >= back for s in starts if s > took)


def test_a_finished_requests_reader_is_not_waited_for(engine):
    """The reader of a finished request never comes back for more: the steps after it, for a
    longer request still decoding beside it, do not wait out the hand-off bound (no command is
    queued meanwhile to cut such a wait short)."""
    loop = EngineLoop(engine, handoff_s=30.0).start()
    try:
        streams = [start_request(loop, "short", max_tokens=2),
                   start_request(loop, "long", max_tokens=20)]
        logs: list[list] = [[], []]
        t0 = time.perf_counter()
        readers = [threading.Thread(target=read, args=(s, 0.0, log))
                   for s, log in zip(streams, logs)]
        for r in readers:
            r.start()
        for r in readers:
            r.join(timeout=60)
            assert not r.is_alive()
        assert all(len(log) >= 1 for log in logs)
        assert time.perf_counter() - t0 < 25  # one wait for the finished reader: 30 s
    finally:
        loop.stop()


def test_a_stalled_reader_costs_one_handoff_not_one_per_step(engine):
    """A reader that takes nothing (a client that stopped reading) is waited for once, when
    its first output is new; while it is still behind, later steps do not wait for it."""
    loop = EngineLoop(engine, handoff_s=0.5).start()
    try:
        t0 = time.perf_counter()
        start_request(loop, "stalled", max_tokens=20)  # never read
        log: list = []
        read(start_request(loop, "read", max_tokens=20), 0.0, log)
        assert len(log) >= 1
        # Waiting at each of its 20 steps would take 10 s.
        assert time.perf_counter() - t0 < 5
    finally:
        loop.stop()


def test_a_negative_handoff_is_refused(engine):
    with pytest.raises(ValueError, match="handoff_s"):
        EngineLoop(engine, handoff_s=-1)
