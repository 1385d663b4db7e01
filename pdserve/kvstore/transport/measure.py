"""Bandwidth of a transport against one extent, beside a memcpy of the same size in the same run.

Owns the timing loop behind `pdserve bench kvstore`: put (write) and get (read_into) of each
size, best of `repeats`, checked byte-exact once, and a plain memoryview copy of the same size as
the baseline (these machines are shared and noisy, so only ratios measured together mean much).
Must not start nodes or choose transports.
"""

from __future__ import annotations

import time

import numpy as np

from pdserve.kvstore.transport.base import Extent, Transport, TransportError

MiB = 1 << 20


def _best_s(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_bandwidth(transport: Transport, extent: Extent,
                      sizes: tuple[int, ...] = (4 * MiB, 64 * MiB), repeats: int = 3) -> dict:
    """Put and get GB/s (1e9 bytes/s) of `transport` at each size, and memcpy GB/s beside them.

    Every size must fit `extent`. Returns {"transport", "repeats", "results": [{"size_bytes",
    "put_gbps", "get_gbps", "memcpy_gbps", "put_vs_memcpy", "get_vs_memcpy"}, ...]}.
    Raises TransportError if a read does not return what was written.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    too_big = [s for s in sizes if s > extent.size]
    if too_big:
        raise ValueError(f"sizes {too_big} exceed the extent's {extent.size} bytes")
    rng = np.random.default_rng(0)
    results = []
    for size in sizes:
        src = rng.integers(0, 256, size, dtype=np.uint8)
        dst = np.zeros(size, dtype=np.uint8)
        src_view, dst_view = memoryview(src), memoryview(dst)
        target = extent.sub(0, size)

        def copy() -> None:
            dst_view[:] = src_view

        put_s = _best_s(lambda: transport.write(target, src_view), repeats)
        get_s = _best_s(lambda: transport.read_into(target, dst_view), repeats)
        if not np.array_equal(src, dst):
            raise TransportError(f"read back of {size} bytes differs from what was written")
        memcpy_s = _best_s(copy, repeats)
        row = {"size_bytes": size, "put_gbps": size / put_s / 1e9,
               "get_gbps": size / get_s / 1e9, "memcpy_gbps": size / memcpy_s / 1e9}
        row["put_vs_memcpy"] = row["put_gbps"] / row["memcpy_gbps"]
        row["get_vs_memcpy"] = row["get_gbps"] / row["memcpy_gbps"]
        results.append(row)
    return {"transport": getattr(transport, "kind", type(transport).__name__),
            "repeats": repeats, "results": results}
