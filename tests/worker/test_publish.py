"""Prompts prefilled on a decode worker, put to the store (`decode_worker/publish.py`), against
a real tiny engine on its engine loop and a real store process on loopback. The store is made
slow the way a host makes it slow: its process is stopped (SIGSTOP), so the publishing thread
blocks inside a put while more offers arrive."""

from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.kvstore.client import KVStoreClient
from pdserve.worker.decode.publish import PromptPublisher
from pdserve.worker.engine_loop import EngineLoop
from pdserve.worker.kv_blocks import block_key
from tests.conftest import SMOLLM2_VOCAB_SIZE
from tests.helpers import free_port, start_process, stop_process

BLOCK = 4


def prompt(n: int, seed: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % (SMOLLM2_VOCAB_SIZE - 3) + 3 for i in range(n)]


@pytest.fixture
def store():
    addr = f"127.0.0.1:{free_port()}"
    p = start_process([sys.executable, "-m", "pdserve.kvstore", "--address", addr], addr)
    yield addr, p
    if p.poll() is None:  # not stopped by the test itself
        os.kill(p.pid, signal.SIGCONT)
        stop_process(p)


@pytest.fixture
def loop(tiny_llama_dir):
    engine = LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(block_size_tokens=BLOCK,
                                                                        num_blocks=256)))
    lp = EngineLoop(engine).start()
    yield lp
    lp.stop()


def prefill(loop: EngineLoop, ids: list[int]) -> None:
    """Compute the prompt in the engine (its full blocks stay cached in the pool)."""
    def run():
        loop.engine.generate([ids], SamplingParams(max_tokens=1))
    loop.call(run)


def keys_of(loop: EngineLoop, ids: list[int]) -> list[str]:
    layers = loop.engine.model_config.num_hidden_layers
    return [block_key("m", "", h, layers)
            for h in prompt_block_hashes(ids[:-1], BLOCK)]


def wait_for(cond, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_offers_past_the_bound_are_dropped_and_the_rest_put_once_the_store_answers(
        loop, store):
    addr, proc = store
    client = KVStoreClient(addr)
    pub = PromptPublisher(loop, client, "m", max_pending_blocks=6)
    prompts = [prompt(13, seed) for seed in range(6)]  # 3 full blocks before the last token
    for ids in prompts:
        prefill(loop, ids)
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # the first put blocks in the store
        pub.offer(prompts[0], "")
        wait_for(lambda: pub._pending == 3, "the first offer was never taken")
        for ids in prompts[1:]:
            pub.offer(ids, "")
        # 3 blocks in the blocked put, 3 queued: the bound is reached, the 4 others dropped.
        wait_for(lambda: pub.offers_dropped == 4, "offers past the bound were not dropped")
        assert pub._pending == 6 and pub.blocks_put == 0
        os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: pub._pending == 0, "the queued offers were never put")
        assert pub.blocks_put == 6 and pub.put_failures == 0
        assert all(client.exists(keys_of(loop, prompts[0])))
        assert all(client.exists(keys_of(loop, prompts[1])))
        assert not any(client.exists(keys_of(loop, prompts[2])))
        # Offered again: the store has them, nothing is put twice.
        pub.offer(prompts[0], "")
        pub.offer(prompts[2], "")
        wait_for(lambda: pub.blocks_put == 9, "the dropped prompt was not put when offered again")
        time.sleep(0.2)
        assert pub.blocks_put == 9 and pub._pending == 0
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
        pub.close()
        client.close()


def test_a_store_that_fails_is_counted_and_publishing_goes_on(loop, store):
    addr, proc = store
    client = KVStoreClient(addr, timeout_s=1.0)
    pub = PromptPublisher(loop, client, "m")
    ids, more = prompt(13, 40), prompt(13, 41)
    prefill(loop, ids)
    prefill(loop, more)
    try:
        stop_process(proc)  # the store is gone
        pub.offer(ids, "")
        wait_for(lambda: pub.put_failures == 1, "a failed put was not counted")
        assert pub.blocks_put == 0 and pub._pending == 0
        assert pub._thread.is_alive()
    finally:
        pub.close()
        client.close()


def test_a_prompt_shorter_than_a_block_offers_nothing(loop, store):
    addr, _ = store
    client = KVStoreClient(addr)
    pub = PromptPublisher(loop, client, "m")
    try:
        with pytest.raises(ValueError, match="max_pending_blocks"):
            PromptPublisher(loop, client, "m", max_pending_blocks=0)
        ids = prompt(BLOCK, 50)  # only the tokens before the last count: no full block
        prefill(loop, ids)
        pub.offer(ids, "")
        time.sleep(0.2)
        assert (pub.blocks_put, pub.offers_dropped, pub._pending) == (0, 0, 0)
    finally:
        pub.close()
        client.close()
