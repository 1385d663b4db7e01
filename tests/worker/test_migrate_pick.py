"""Which running decodes a balance move takes (`Migrator.most_left`): those with the most tokens
left to generate, ties by request id; never more than asked, nor more than run, nor one without
a stream to end. On a real engine loop (tiny Llama, in one process)."""

from __future__ import annotations

from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams
from pdserve.worker.decode.migrate import Migrator, most_left
from pdserve.worker.engine_loop import EngineLoop


def test_most_tokens_left_first_ties_by_request_id():
    left = {"c": 5, "b": 90, "a": 90, "d": 1}
    assert most_left(left, 3) == ["a", "b", "c"]
    assert most_left(left, 10) == ["a", "b", "c", "d"]  # bounded by what runs
    assert most_left({}, 2) == [] and most_left(left, 0) == []


def test_a_move_picks_the_running_decodes_with_most_tokens_left(tiny_llama_dir):
    loop = EngineLoop(LLMEngine(EngineConfig(tiny_llama_dir, cache=CacheConfig(
        block_size_tokens=16, num_blocks=128)))).start()
    prompt = list(range(40, 48))
    try:
        def add():  # one call: every request runs the same steps, so the gaps stay as given
            for rid, max_tokens in (("r1", 150), ("r3", 400), ("r2", 400), ("r4", 250)):
                loop.open_stream(rid)
                loop.engine.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens,
                                                                    ignore_eos=True))
            # A request with no stream to end (a prefill's, say) is not the move's to take.
            loop.engine.add_request("p", prompt, SamplingParams(max_tokens=450, ignore_eos=True))

        loop.call(add)
        migrator = Migrator(loop, store=None, model_id="tiny@float32")
        assert migrator.most_left(3) == ["r2", "r3", "r4"]
        assert migrator.most_left(9) == ["r2", "r3", "r4", "r1"]
    finally:
        loop.stop()
