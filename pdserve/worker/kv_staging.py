"""Host staging for KV bytes leaving or entering device memory, through a bounded buffer pool.

Owns a pool of host byte buffers (page-locked when CUDA is available, so copies run as DMA
without blocking the host thread; plain memory otherwise) bounded in bytes, and the two copies
through it: device -> host before the bytes go to the store (`host_views`), and host -> device
after the store wrote them (`fetch_many`). Copies are `non_blocking` on a side CUDA stream,
ordered after the work that produced the tensor (an event on its stream), and a CUDA event is
waited before the bytes are handed over, so the store never reads a half-copied buffer; on the
way in, up to a pool's worth of blocks is in flight while the next ones are read from the store.

CPU tensors are not staged: their own bytes are handed over (zero copy, as before), unless the
pool is built with `stage_cpu=True` (how the staging itself is tested on a machine without
CUDA). Past the pool's capacity a caller waits for a buffer (up to `wait_s`, then
`StagingTimeout`); one object larger than the pool is refused (`StagingError`). CUDA IPC between
GPUs of one host is not used: bytes always cross host memory. Must not do store I/O itself.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from pdserve.worker.torch_lazy import torch

_MIN_BUFFER_BYTES = 64 << 10
log = logging.getLogger(__name__)


class StagingError(RuntimeError):
    """An object cannot be staged (larger than the whole pool)."""


class StagingTimeout(StagingError):
    """No staging buffer came free within the wait."""


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _bucket(nbytes: int) -> int:
    """Buffers come in powers of two (at least 64 KiB), so freed ones fit the next objects."""
    return max(_MIN_BUFFER_BYTES, 1 << max(0, nbytes - 1).bit_length())


class HostStaging:
    def __init__(self, capacity_bytes: int = 128 << 20, *, pin: bool | None = None,
                 stage_cpu: bool = False, wait_s: float = 30.0) -> None:
        if capacity_bytes < _MIN_BUFFER_BYTES:
            raise ValueError(f"capacity_bytes must be >= {_MIN_BUFFER_BYTES}, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.stage_cpu = stage_cpu
        self.wait_s = wait_s
        self._free: dict[int, list[torch.Tensor]] = {}
        self.allocated_bytes = 0  # held by the pool: in use + free
        self.in_use_bytes = 0
        self.peak_allocated_bytes = 0
        self._cond = threading.Condition()
        self._streams: dict[torch.device, object] = {}

    # ---- the pool ------------------------------------------------------------------------------
    def acquire(self, nbytes: int) -> torch.Tensor:
        """A host uint8 buffer of exactly `nbytes` (a view of a pooled one); give it back with
        `release`. Waits while the pool is full."""
        size = _bucket(nbytes)
        if size > self.capacity_bytes:
            raise StagingError(f"an object of {nbytes} bytes does not fit the staging pool of "
                               f"{self.capacity_bytes} bytes")
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            while True:
                free = self._free.get(size)
                if free:
                    buf = free.pop()
                    break
                self._drop_free_until(size)
                if self.allocated_bytes + size <= self.capacity_bytes:
                    buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
                    self.allocated_bytes += size
                    self.peak_allocated_bytes = max(self.peak_allocated_bytes,
                                                    self.allocated_bytes)
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StagingTimeout(f"no staging buffer of {size} bytes came free within "
                                         f"{self.wait_s:g}s ({self.in_use_bytes} of "
                                         f"{self.capacity_bytes} bytes in use)")
                self._cond.wait(left)
            self.in_use_bytes += size
        return buf[:nbytes]

    def release(self, view: torch.Tensor) -> None:
        base = view._base if view._base is not None else view
        size = base.numel()
        with self._cond:
            self.in_use_bytes -= size
            self._free.setdefault(size, []).append(base)
            self._cond.notify_all()

    def _drop_free_until(self, size: int) -> None:
        """Free cached buffers of other sizes until `size` more bytes fit (under the lock)."""
        for other in list(self._free):
            while self._free[other] and self.allocated_bytes + size > self.capacity_bytes:
                self._free[other].pop()
                self.allocated_bytes -= other

    def _stages(self, t: torch.Tensor) -> bool:
        return t.device.type != "cpu" or self.stage_cpu

    def _side_stream(self, device: torch.device):
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]

    # ---- device -> host --------------------------------------------------------------------------
    @contextlib.contextmanager
    def host_views(self, tensors: list[torch.Tensor]) -> Iterator[list[memoryview]]:
        """Byte views of `tensors` in host memory, valid inside the `with` block.

        CPU tensors: their own bytes. Device tensors: one staging buffer holds them all, filled
        by asynchronous copies that have finished when the block is entered."""
        if not any(self._stages(t) for t in tensors):
            yield [memoryview(_byte_view(t).numpy()) for t in tensors]
            return
        sizes = [t.numel() * t.element_size() for t in tensors]
        buf = self.acquire(sum(sizes))
        try:
            views, at = [], 0
            cuda = [t for t in tensors if t.device.type == "cuda"]
            stream = self._side_stream(cuda[0].device) if cuda else None
            if stream is not None:  # the copies follow the work that wrote the tensors
                stream.wait_stream(torch.cuda.current_stream(cuda[0].device))
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for t, n in zip(tensors, sizes):
                    buf[at:at + n].copy_(_byte_view(t), non_blocking=True)
                    views.append(buf[at:at + n])
                    at += n
            if stream is not None:
                done = torch.cuda.Event()
                done.record(stream)
                done.synchronize()  # the bytes are all in host memory before anyone reads them
            yield [memoryview(v.numpy()) for v in views]
        finally:
            self.release(buf)

    # ---- host -> device -------------------------------------------------------------------------
    def fetch_many(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str,
                   reads: list[Callable[[Any], int]]) -> list[torch.Tensor | None]:
        """One tensor of (shape, dtype) on `device` per read, in order, up to the first read
        that does not fill one. A read fills a host byte array and returns how many bytes it
        wrote (-1: not there).

        CPU without `stage_cpu`: each read fills the new tensor's own bytes. Otherwise each read
        fills a staging buffer whose copy to the device runs while the next read goes on; the
        tensors are ready for the device's current stream when this returns."""
        device = torch.device(device)
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        out: list[torch.Tensor | None] = []
        if device.type == "cpu" and not self.stage_cpu:
            for read in reads:
                t = torch.empty(shape, dtype=dtype)
                if read(_byte_view(t).numpy()) != nbytes:
                    break
                out.append(t)
            return out
        cuda = device.type == "cuda"
        stream = self._side_stream(device) if cuda else None
        in_flight: deque[tuple[torch.Tensor, object]] = deque()
        limit = max(1, self.capacity_bytes // (2 * _bucket(nbytes)))  # leave room for others
        try:
            for read in reads:
                if len(in_flight) >= limit:
                    self._land(*in_flight.popleft())
                try:
                    buf = self.acquire(nbytes)
                except StagingError as e:  # the rest is recomputed, as for a missing block
                    log.warning("KV fetch stops after %d blocks: %s", len(out), e)
                    break
                if read(buf.numpy()) != nbytes:
                    self.release(buf)
                    break
                t = torch.empty(shape, dtype=dtype, device=device)
                with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
                    if cuda:
                        stream.wait_stream(torch.cuda.current_stream(device))  # t's allocation
                    _byte_view(t).copy_(buf, non_blocking=True)
                    event = None
                    if cuda:
                        event = torch.cuda.Event()
                        event.record(stream)
                        torch.cuda.current_stream(device).wait_event(event)  # users see the bytes
                in_flight.append((buf, event))
                out.append(t)
        finally:
            while in_flight:
                self._land(*in_flight.popleft())
        return out

    def _land(self, buf: torch.Tensor, event) -> None:
        """Wait for a host -> device copy out of `buf`, then give the buffer back."""
        if event is not None:
            event.synchronize()
        self.release(buf)


_default: HostStaging | None = None
_default_lock = threading.Lock()


def default_staging() -> HostStaging:
    """The process's staging pool (made on first use: pinned when CUDA is available)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = HostStaging()
        return _default
