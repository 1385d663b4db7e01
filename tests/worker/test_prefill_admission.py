"""When a prompt reaches the prefill engine, over a real store (its own process, over gRPC):
prompts that arrive while a step runs all join the engine at the end of that step, so they are
prefilled together in the next one; none waits a step more than the others. The step in
progress is stood in for by a command that holds the engine thread (what a long step does)."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.kvstore.client import KVStoreClient
from pdserve.worker.prefill.role import PrefillRole
from pdserve.worker.engine_loop import EngineLoop
from tests.conftest import make_tiny_hf_model
from tests.helpers import free_port, start_process, stop_process

MODEL = "tiny-admission@float32"


@pytest.fixture(scope="module")
def store_address():
    address = f"127.0.0.1:{free_port()}"
    p = start_process([sys.executable, "-m", "pdserve.kvstore", "--address", address,
                       "--capacity-bytes", str(64 << 20)], address, timeout_s=30)
    yield address
    stop_process(p)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_prefill_admission"), "llama")


def test_a_burst_arriving_during_a_step_is_prefilled_in_the_next_one(llama_dir, store_address):
    loop = EngineLoop(LLMEngine(EngineConfig(
        llama_dir, cache=CacheConfig(block_size_tokens=4, num_blocks=128),
        scheduler=SchedulerConfig(max_num_batched_tokens=256)))).start()
    store = KVStoreClient(store_address, timeout_s=10)
    role = PrefillRole(loop, store, MODEL)
    try:
        n = 6
        # Distinct prompts of 3 full blocks and a token, none in the store or the local cache: each is looked up in the store (and
        # missed) before it can join, as a new prompt is.
        prompts = [[10 + i * 20 + j for j in range(13)] for i in range(n)]
        results: list = [None] * n
        busy = threading.Event()

        def long_step() -> None:
            busy.set()
            time.sleep(1.0)

        loop.post(long_step)
        assert busy.wait(10)
        steps_before = loop.steps

        def one(i: int) -> None:
            results[i] = role.prefill(f"r{i}", prompts[i], SamplingParams(max_tokens=4))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(r is not None for r in results)
        # Every block of the prompt, the partial last one included, is named and put.
        assert all(r.first_token >= 0 and len(r.block_hashes) == 4 for r in results)
        # All six joined when the held step ended and were prefilled in one step.
        assert loop.steps - steps_before == 1
        assert role.blocks_put == 4 * n
    finally:
        loop.stop()
        store.close()
