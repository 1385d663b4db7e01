"""CUDA-graph capture of a decode step for fixed batch sizes (buckets).

Owns the bucket sizes (`capture_sizes`), the choice of bucket for a batch (`choose_bucket`),
whether capture is on (`enabled`: `PDSERVE_CUDA_GRAPH=1`, off by default), and `GraphedStep`,
which runs a step function on static, padded input buffers. On CUDA it captures one graph per
bucket the first time that bucket is used and replays it afterwards, so a decode step costs one
launch instead of one per kernel (at batch 1 on a fast GPU the launches, not the memory, bound a
small model's step). Elsewhere it runs the function eagerly on the same padded buffers, so the
padding and slicing are one code path on every device. A batch larger than the largest bucket
runs eagerly, unpadded.

The function must be graph-safe: it reads only its static inputs (the same shapes and addresses
every call), reads nothing back to the host (`.item()`, `.tolist()`) and allocates nothing whose
size depends on values; padding rows must be harmless, which the caller ensures through each
input's padding value (for a slot mapping: a scratch slot no sequence owns). The output of a
replay lives in the graph's memory until the next call of the same bucket. It must not schedule
or build the batch: the caller hands it one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

ENV = "PDSERVE_CUDA_GRAPH"
WARMUP_RUNS = 2  # eager runs on a side stream before capture: kernels compiled, handles made


def enabled() -> bool:
    """`PDSERVE_CUDA_GRAPH`: "1" captures decode steps on CUDA; unset or "0" does not."""
    value = os.environ.get(ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def capture_sizes(max_batch: int) -> tuple[int, ...]:
    """The buckets for batches up to `max_batch`: 1, 2, 4, 8, then every multiple of 8 up to the
    first that holds `max_batch` (below 8: the powers of two up to the one that holds it). Small
    batches get tight buckets (little padding where a step is cheapest); large ones pad at most
    7 rows."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    if max_batch <= 8:
        return (*sizes, 1 << (max_batch - 1).bit_length())  # the power of two that holds it
    return (*sizes, *range(8, -(-max_batch // 8) * 8 + 1, 8))


def choose_bucket(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds `batch` rows; None when none does (run eagerly)."""
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    return min((s for s in sizes if s >= batch), default=None)


@dataclass(frozen=True)
class StaticInput:
    """One input of the step: [rows, *row_shape] of `dtype`; padding rows are filled with `pad`."""

    name: str
    row_shape: tuple[int, ...]
    dtype: torch.dtype
    pad: float | int = 0


class GraphedStep:
    """`fn(inputs: dict[str, Tensor]) -> Tensor` ([rows, ...]) run on padded static buffers, one
    set per bucket; captured and replayed on CUDA when `capture` (default: `enabled()`)."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor]], torch.Tensor],
                 inputs: Sequence[StaticInput], sizes: Sequence[int], device: torch.device,
                 capture: bool | None = None) -> None:
        if not inputs:
            raise ValueError("inputs must name at least one tensor")
        self.fn = fn
        self.inputs = tuple(inputs)
        self.sizes = tuple(sorted(sizes))
        self.device = torch.device(device)
        self.capture = (enabled() if capture is None else capture) and self.device.type == "cuda"
        self._buffers: dict[int, dict[str, torch.Tensor]] = {}
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    @property
    def captured(self) -> list[int]:
        """The buckets captured so far."""
        return sorted(self._graphs)

    def __call__(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        n = batch[self.inputs[0].name].shape[0]
        for spec in self.inputs:
            x = batch[spec.name]
            if tuple(x.shape) != (n, *spec.row_shape) or x.dtype != spec.dtype:
                raise ValueError(f"input {spec.name!r}: want [{n}, {', '.join(map(str, spec.row_shape))}] "
                                 f"{spec.dtype}, got {list(x.shape)} {x.dtype}")
        bucket = choose_bucket(n, self.sizes)
        if bucket is None:
            return self.fn(batch)
        static = self._static(bucket)
        for spec in self.inputs:
            buf = static[spec.name]
            buf[:n].copy_(batch[spec.name])
            buf[n:].fill_(spec.pad)  # rows a larger batch left must not run again
        if not self.capture:
            return self.fn(static)[:n]
        if bucket not in self._graphs:
            self._graphs[bucket] = self._capture(static)
        graph, out = self._graphs[bucket]
        graph.replay()
        return out[:n]

    def _static(self, bucket: int) -> dict[str, torch.Tensor]:
        if bucket not in self._buffers:
            self._buffers[bucket] = {
                s.name: torch.full((bucket, *s.row_shape), s.pad, dtype=s.dtype, device=self.device)
                for s in self.inputs}
        return self._buffers[bucket]

    def _capture(self, static: dict[str, torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (Triton compiles, cuBLAS makes its handles: neither may
        # happen during capture), then capture into one memory pool shared by every bucket.
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.fn(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.fn(static)
        return graph, out
