"""The C backend of the anchor/residual KV codec: split, join and dequantize-anchor on CPU tensors.

Owns building and loading `kvcodec_c.c` (the format's loops in plain C99) and calling it through
ctypes on contiguous CPU tensors; the planes it writes are byte-identical to the PyTorch reference
in `kvcodec`, which owns the format, validates sizes and picks this backend (`backend="c"`, or
`"auto"` for CPU tensors when it builds). The library is compiled on first use with `$CC` (default
gcc) into `$PDSERVE_CACHE/kvcodec` (default `~/.cache/pdserve/kvcodec`), named by a hash of the
source, compiler and flags, so an edit recompiles; the compile writes a temp file that is
`os.replace`d into place, so concurrent processes never load a half-written library.
`KernelUnavailable` says why it could not be built (no compiler, a compile error).

ctypes releases the GIL during a call, so `threads > 1` runs group ranges of one tensor from a
small thread pool (chunks of at least 2^20 values); the chunks write disjoint bytes. `out=` writes
into a caller's buffers: large fresh allocations page-fault on every call (glibc maps anything
over 32 MiB anew), which costs more than the codec, so a hot path should reuse its buffers.
"""

from __future__ import annotations

import ctypes
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from pdserve.engine import cbuild
from pdserve.engine.cbuild import KernelUnavailable

SOURCE = Path(__file__).with_name("kvcodec_c.c")
CFLAGS = ("-O3", "-std=c99", "-shared", "-fPIC")
ABI = 1  # kvc_abi() of the source this module speaks to
GROUP_SIZE = 32  # mirrors kvcodec.GROUP_SIZE (a chunk boundary must be a group boundary)
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
_RBYTES = {torch.float32: 3, torch.bfloat16: 1, torch.float16: 1}
_WHAT = "kvcodec C backend"
_MIN_CHUNK_GROUPS = 1 << 15  # 1 Mi values: below this a thread hand-off costs more than it saves

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: KernelUnavailable | None = None
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def cache_dir() -> Path:
    return cbuild.cache_dir("kvcodec")


def library_path() -> Path:
    """Where the compiled library for this source, compiler and flags lives (built or not)."""
    return cbuild.library_path(SOURCE, CFLAGS, "kvcodec", _WHAT, KernelUnavailable,
                               "; backend='auto' falls back to the PyTorch reference")


def _build(target: Path) -> None:
    cbuild.build(SOURCE, target, CFLAGS, _WHAT, KernelUnavailable)


def _load() -> ctypes.CDLL:
    global _lib, _error
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise _error
        try:
            path = library_path()
            if not path.exists():
                _build(path)
            lib = ctypes.CDLL(str(path))
            if lib.kvc_abi() != ABI:
                raise KernelUnavailable(f"kvcodec C backend: {path} has ABI {lib.kvc_abi()}, want {ABI}")
        except KernelUnavailable as exc:
            _error = exc
            raise
        except OSError as exc:  # unwritable cache dir, a library that will not load
            _error = KernelUnavailable(f"kvcodec C backend: {exc}")
            raise _error from exc
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.kvc_split.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, i64]
        lib.kvc_join.argtypes = [ctypes.c_int, ptr, ptr, ptr, i64, i64, i64]
        lib.kvc_dequantize.argtypes = [ctypes.c_int, ptr, ptr, i64, i64, i64]
        for fn in (lib.kvc_split, lib.kvc_join, lib.kvc_dequantize):
            fn.restype = ctypes.c_int
        _lib = lib
        return lib


def load() -> None:
    """Build and load the library now; raises `KernelUnavailable` if it cannot."""
    _load()


def available() -> bool:
    """Whether the C backend builds and loads here (the answer is remembered per process)."""
    try:
        _load()
    except KernelUnavailable:
        return False
    return True


def _run(fn, n: int, threads: int, *args) -> None:
    """fn(*args, n, g0, g1) over all groups, cut into up to `threads` chunks."""
    ngroups = -(-n // GROUP_SIZE)
    chunks = max(1, min(threads, ngroups // _MIN_CHUNK_GROUPS))
    if chunks == 1:
        rc = fn(*args, n, 0, ngroups)
        if rc != 0:
            raise RuntimeError(f"kvcodec C backend: {fn.__name__} returned {rc}")
        return
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < chunks:
            if _pool is not None:
                _pool.shutdown(wait=False)  # running chunks finish; new ones go to the bigger pool
            _pool, _pool_size = ThreadPoolExecutor(max_workers=chunks, thread_name_prefix="kvcodec-c"), chunks
        pool = _pool
    bounds = [ngroups * k // chunks for k in range(chunks + 1)]
    futures = [pool.submit(fn, *args, n, g0, g1) for g0, g1 in zip(bounds, bounds[1:])]
    rcs = [f.result() for f in futures]
    if any(rcs):
        raise RuntimeError(f"kvcodec C backend: {fn.__name__} returned {rcs}")


def _check_cpu(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"kvcodec C backend: want contiguous CPU tensors, got {t.device} "
                             f"contiguous={t.is_contiguous()}")


def _out(out: torch.Tensor | None, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """A caller's buffer (reused, so no page faults per call), checked; else a fresh one."""
    if out is None:
        return torch.empty(numel, dtype=dtype)
    _check_cpu(out)
    if out.dtype != dtype or out.numel() != numel:
        raise ValueError(f"kvcodec C backend: out is {out.dtype} x {out.numel()}, want {dtype} x {numel}")
    return out


def split(x: torch.Tensor, threads: int = 1,
          out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x (contiguous, CPU, fp32/bf16/fp16) -> (anchor, residual), as `kvcodec.split`; `out`: the
    two uint8 planes to write into (sizes as `CodecSpec`), returned."""
    lib = _load()
    _check_cpu(x)
    n = x.numel()
    ngroups = 0 if x.dtype == torch.float16 else -(-n // GROUP_SIZE)
    anchor = _out(out and out[0], torch.uint8, ngroups + n)
    residual = _out(out and out[1], torch.uint8, _RBYTES[x.dtype] * n)
    if n:
        _run(lib.kvc_split, n, threads, _DTYPE_CODES[x.dtype], x.data_ptr(), anchor.data_ptr(),
             residual.data_ptr())
    return anchor, residual


def join(anchor: torch.Tensor, residual: torch.Tensor, dtype: torch.dtype,
         shape: tuple[int, ...], threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """Planes (sizes already checked by `kvcodec.join`) -> the tensor, bit for bit; `out`: a
    contiguous tensor of `dtype` and n values to write into."""
    lib = _load()
    _check_cpu(anchor, residual)
    n = math.prod(shape)
    out = _out(None if out is None else out.view(-1).view(_INT_VIEW[dtype]), _INT_VIEW[dtype], n)
    if n:
        _run(lib.kvc_join, n, threads, _DTYPE_CODES[dtype], anchor.data_ptr(), residual.data_ptr(),
             out.data_ptr())
    return out.view(dtype).reshape(shape)


def dequantize_anchor(anchor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...],
                      threads: int = 1, out: torch.Tensor | None = None) -> torch.Tensor:
    """The anchor plane alone -> an approximation, as `kvcodec.dequantize_anchor`; `out` as `join`."""
    lib = _load()
    _check_cpu(anchor)
    n = math.prod(shape)
    out = _out(None if out is None else out.view(-1).view(_INT_VIEW[dtype]), _INT_VIEW[dtype], n)
    if n:
        _run(lib.kvc_dequantize, n, threads, _DTYPE_CODES[dtype], anchor.data_ptr(), out.data_ptr())
    return out.view(dtype).reshape(shape)
