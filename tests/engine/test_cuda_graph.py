"""Decode-step graph capture: the bucket sizes and the choice of bucket (pure), the switch, and
`GraphedStep`'s padding: a batch runs on its bucket's static buffers with the spare rows reset to
their padding value (never a larger batch's leftovers), the caller sees only its rows, and a
batch past the largest bucket runs unpadded. On CUDA each bucket is captured once and replayed."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import cuda_graph
from pdserve.engine.cuda_graph import GraphedStep, StaticInput, capture_sizes, choose_bucket


@pytest.mark.parametrize("max_batch,want", [
    (1, (1,)), (2, (1, 2)), (3, (1, 2, 4)), (8, (1, 2, 4, 8)), (9, (1, 2, 4, 8, 16)),
    (20, (1, 2, 4, 8, 16, 24)), (32, (1, 2, 4, 8, 16, 24, 32)),
])
def test_capture_sizes_cover_the_largest_batch(max_batch, want):
    assert capture_sizes(max_batch) == want


def test_every_batch_gets_the_smallest_bucket_that_holds_it():
    sizes = capture_sizes(128)
    for batch in range(1, 129):
        bucket = choose_bucket(batch, sizes)
        assert bucket >= batch and bucket - batch < (8 if batch > 8 else batch)
        assert all(s < batch for s in sizes if s < bucket)
    assert choose_bucket(129, sizes) is None  # past the largest: eager
    with pytest.raises(ValueError, match="batch must be at least 1"):
        choose_bucket(0, sizes)
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        capture_sizes(0)


def test_the_switch_is_off_by_default_and_names_itself(monkeypatch):
    monkeypatch.delenv(cuda_graph.ENV, raising=False)
    assert not cuda_graph.enabled()
    monkeypatch.setenv(cuda_graph.ENV, "1")
    assert cuda_graph.enabled()
    monkeypatch.setenv(cuda_graph.ENV, "yes")
    with pytest.raises(ValueError, match="PDSERVE_CUDA_GRAPH must be 0 or 1"):
        cuda_graph.enabled()


def make_step(device: torch.device, capture: bool):
    """A step that scatters rows into a table at their slots (as a step writes KV) and returns
    x * 2 + slot: padding rows write to the scratch slot 0 only."""
    table = torch.zeros(64, 3, device=device)
    seen: list[torch.Tensor] = []
    ptrs: list[int] = []

    def fn(inp):
        seen.append(inp["slot"].clone())
        ptrs.append(inp["x"].data_ptr())
        table.index_copy_(0, inp["slot"], inp["x"])
        return inp["x"] * 2 + inp["slot"].unsqueeze(1)

    step = GraphedStep(fn, [StaticInput("x", (3,), torch.float32, 0.0),
                            StaticInput("slot", (), torch.long, 0)], (1, 2, 4, 8), device, capture)
    return step, table, seen, ptrs


def batch(n: int, device: torch.device, first_slot: int = 1) -> dict[str, torch.Tensor]:
    x = torch.arange(n * 3, dtype=torch.float32, device=device).view(n, 3) + 1
    return {"x": x, "slot": torch.arange(first_slot, first_slot + n, device=device)}


def test_cpu_runs_eagerly_on_padded_static_buffers():
    cpu = torch.device("cpu")
    step, table, seen, ptrs = make_step(cpu, capture=True)  # capture only ever happens on CUDA
    assert not step.capture
    big = batch(7, cpu, first_slot=10)
    torch.testing.assert_close(step(big), big["x"] * 2 + big["slot"].unsqueeze(1))
    assert seen[-1].tolist() == [10, 11, 12, 13, 14, 15, 16, 0]  # bucket 8, one padding row
    small = batch(5, cpu, first_slot=30)
    out = step(small)
    assert out.shape == (5, 3)
    assert seen[-1].tolist() == [30, 31, 32, 33, 34, 0, 0, 0]  # the 7-row batch's rows reset
    assert ptrs[0] == ptrs[1]  # one set of buffers per bucket, reused
    assert table[35:].abs().sum() == 0 and table[15:17].abs().sum() > 0
    past = batch(9, cpu, first_slot=40)
    torch.testing.assert_close(step(past), past["x"] * 2 + past["slot"].unsqueeze(1))
    assert len(seen[-1]) == 9  # unpadded, eager
    with pytest.raises(ValueError, match="input 'slot'"):
        step({"x": small["x"], "slot": small["slot"].int()})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_captures_each_bucket_once_and_replays_it():
    dev = torch.device("cuda")
    step, table, seen, _ = make_step(dev, capture=True)
    for n, first in ((3, 1), (4, 10), (2, 20), (7, 30), (3, 40)):
        b = batch(n, dev, first)
        torch.testing.assert_close(step(b), b["x"] * 2 + b["slot"].unsqueeze(1))
        torch.testing.assert_close(table[first:first + n], b["x"])
    assert step.captured == [2, 4, 8]
    # Warm-up and capture ran the function; replays do not call Python at all.
    assert len(seen) == 3 * (cuda_graph.WARMUP_RUNS + 1)
