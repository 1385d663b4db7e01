"""A worker's internal timeouts never fail a request and then run it anyway holding its KV.

A real worker service (both roles over one engine loop) on a real gRPC server in this process,
so cancellations and deadlines are gRPC's own. The one fault injected is a slow engine step (a
sleep in front of `engine.step`, released by the test): a step that outlives a command's wait
makes the command `EngineBusy` (UNAVAILABLE with a message; the request never entered the
engine), a caller that leaves or times out gets its request aborted, and a prefill past its
result timeout answers DEADLINE_EXCEEDED with a message. After each, the engine's used KV
blocks (total - free) are back at their idle value and no request is left in it.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from pdserve import rpc
from pdserve.core.identity import WORKER
from pdserve.worker.decode.role import DecodeRole
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.kvstore.dist_client import DistStoreClient
from pdserve.kvstore.retry import StoreRetryPolicy
from pdserve.worker.prefill.role import PrefillRole
from pdserve.proto import common_pb2
from pdserve.proto import worker_pb2 as wpb
from pdserve.proto import worker_pb2_grpc as wpb_grpc
from pdserve.worker.engine_loop import EngineBusy, EngineLoop
from pdserve.worker.guarded_store import GuardedStore
from pdserve.worker.service import WorkerService
from tests.helpers import free_port

MODEL = "tiny@float32"
PROMPT = [(7 * i + 3) % 500 + 3 for i in range(40)]


class SlowSteps:
    """Installed over `engine.step`: while `delay_s` is set each step first sleeps that long;
    `entered` is set when a slow step starts sleeping."""

    def __init__(self, engine) -> None:
        self._step = engine.step
        self.delay_s = 0.0
        self.entered = threading.Event()
        engine.step = self

    def __call__(self):
        if self.delay_s:
            self.entered.set()
            time.sleep(self.delay_s)
        return self._step()


@pytest.fixture
def worker(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(
        block_size_tokens=4, num_blocks=128), scheduler=SchedulerConfig(max_num_batched_tokens=8)))
    slow = SlowSteps(engine)
    loop = EngineLoop(engine, call_timeout_s=0.3).start()
    # No store answers here; these requests never reach it (or give up on it at once).
    store = GuardedStore(DistStoreClient(f"127.0.0.1:{free_port()}",
                                         retry=StoreRetryPolicy(budget_s=0.2)))
    prefill = PrefillRole(loop, store, MODEL, result_timeout_s=30.0)
    service = WorkerService(loop, prefill, DecodeRole(loop, store, poll_s=0.02),
                            wpb.ROLE_DECODE, MODEL)
    server = rpc.make_server(8)
    rpc.add_servicer(server, wpb_grpc.add_WorkerServicer_to_server, service, rpc.Guard(WORKER))
    address = f"127.0.0.1:{free_port()}"
    rpc.bind(server, address, WORKER)
    server.start()
    channel = rpc.make_channel(address, WORKER)
    yield wpb_grpc.WorkerStub(channel), service, slow, loop
    slow.delay_s = 0.0
    channel.close()
    server.stop(0)
    loop.stop()
    store.close()


def used_blocks(loop: EngineLoop) -> int:
    s = loop.call(loop.engine.stats, timeout=30)
    return s["num_total_blocks"] - s["num_free_blocks"]


def settled(loop: EngineLoop, idle: int, timeout_s: float = 20.0) -> None:
    """Waits until no request is left in the engine and its used blocks are `idle` again."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = loop.call(lambda: (len(loop.engine.seqs), len(loop.engine.parked)), timeout=30)
        used = used_blocks(loop)
        if left == (0, 0) and used == idle:
            return
        assert time.monotonic() < deadline, f"requests left {left}, used blocks {used} != {idle}"
        time.sleep(0.05)


def local_decode(stub, rid: str, max_tokens: int, timeout: float):
    return stub.Decode(wpb.DecodeRequest(
        request_id=rid, prompt_token_ids=PROMPT, prefill_locally=True,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True)),
        timeout=timeout)


def test_a_decode_past_its_deadline_is_aborted_and_its_blocks_freed(worker):
    stub, service, slow, loop = worker
    idle = used_blocks(loop)
    slow.delay_s = 0.2
    call = local_decode(stub, "late", max_tokens=200, timeout=1.5)
    with pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    slow.delay_s = 0.0
    settled(loop, idle)


def test_a_command_the_busy_engine_could_not_take_never_runs(worker):
    stub, service, slow, loop = worker
    idle = used_blocks(loop)
    running = local_decode(stub, "running", max_tokens=300, timeout=60)
    first = next(running)  # a request is decoding: the engine steps continuously
    assert first.token_ids
    slow.delay_s = 1.5
    assert slow.entered.wait(10)  # a slow step holds the engine thread now
    with pytest.raises(grpc.RpcError) as e:
        for _ in local_decode(stub, "busy", max_tokens=5, timeout=30):
            pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "worker busy" in e.value.details() and "nothing was done" in e.value.details()
    slow.delay_s = 0.0
    assert "busy" not in loop.call(lambda: set(loop.engine.seqs), timeout=30)
    running.cancel()
    settled(loop, idle)


def test_a_prefill_whose_caller_leaves_is_aborted_and_its_blocks_freed(worker):
    stub, service, slow, loop = worker
    service.role = wpb.ROLE_PREFILL
    idle = used_blocks(loop)
    slow.delay_s = 0.4  # 40 prompt tokens, 8 a step: about 2 s of prefill
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(wpb.PrefillRequest(request_id="gone", prompt_token_ids=PROMPT,
                                        sampling=common_pb2.SamplingParams(max_tokens=4)),
                     timeout=0.6)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    settled(loop, idle)
    slow.delay_s = 0.0
    # Aborted, not run to its end and dropped: part of the prompt was never computed.
    assert computed(loop) < len(PROMPT)


def computed(loop: EngineLoop) -> int:
    return loop.call(loop.engine.stats, timeout=30)["prompt_tokens_computed"]


def test_a_prefill_past_its_result_timeout_is_a_clear_deadline_exceeded(worker):
    stub, service, slow, loop = worker
    service.role = wpb.ROLE_PREFILL
    service.prefill_role.timeout_s = 0.5
    idle = used_blocks(loop)
    slow.delay_s = 0.4
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(wpb.PrefillRequest(request_id="slow", prompt_token_ids=PROMPT,
                                        sampling=common_pb2.SamplingParams(max_tokens=4)),
                     timeout=30)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "did not finish within 0.5s" in e.value.details()
    settled(loop, idle)
    slow.delay_s = 0.0
    assert computed(loop) < len(PROMPT)


def test_engine_loop_call_cancels_what_it_gave_up_on_and_keeps_what_ran(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(block_size_tokens=4,
                                                                      num_blocks=16)))
    loop = EngineLoop(engine, call_timeout_s=0.2).start()
    try:
        ran = threading.Event()
        hold = threading.Event()
        blocker = threading.Thread(target=lambda: loop.call(hold.wait, timeout=30))
        blocker.start()  # the engine thread runs a command that waits: it takes no other
        time.sleep(0.1)
        with pytest.raises(EngineBusy, match="nothing was done"):
            loop.call(ran.set)
        hold.set()
        blocker.join()
        assert loop.call(lambda: 7) == 7  # the thread went on; the cancelled one never ran
        assert not ran.is_set()
        # A command that is already running when its wait ends is waited for, not dropped.
        assert loop.call(lambda: time.sleep(0.5) or "done", timeout=0.1) == "done"
    finally:
        loop.stop()
