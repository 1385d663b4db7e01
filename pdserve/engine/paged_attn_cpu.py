"""The C paged-attention kernel for decode rows on CPU: build, load, call.

Owns building and loading `paged_attn_c.c` and calling it through ctypes on CPU tensors: the
decode spans of one step (each sequence's query rows, query count, context length and block
table) against one layer's paged K/V cache, read in place through the block tables (no gather,
no padding, no mask tensors). `attention.py` owns the math's reference and decides when this runs.
Supports fp32 and bf16 caches; GQA; spans of Q >= 1 query rows with the causal mask over the
last Q positions (speculative verification). It must not decide which blocks a sequence owns.

The library is compiled on first use with `$CC` (default gcc) into `$PDSERVE_CACHE/paged_attn`
(default `~/.cache/pdserve/paged_attn`), named by a hash of the source, compiler and flags, so an
edit recompiles; the compile writes a temp file that is `os.replace`d into place, so concurrent
processes never load a half-written library. It is built with OpenMP when the compiler has it
(the same `libgomp.so.1` torch already loaded, so one thread pool, no second set of spinning
threads), else single-threaded. `KernelUnavailable` says why it could not be built.
Threads: `torch.get_num_threads()` at each call, the engine's own setting.
"""

from __future__ import annotations

import ctypes
import math
import threading
from pathlib import Path

import torch

from pdserve.engine import cbuild
from pdserve.engine.cbuild import KernelUnavailable, NoCompiler  # noqa: F401 - re-exported

SOURCE = Path(__file__).with_name("paged_attn_c.c")
BASE_FLAGS = ("-O3", "-std=gnu99", "-ffp-contract=fast", "-shared", "-fPIC")
# Tried in order: OpenMP threads, else vectorised loops on one thread.
FLAG_SETS = (BASE_FLAGS + ("-fopenmp",), BASE_FLAGS + ("-fopenmp-simd",))
ABI = 1  # pa_abi() of the source this module speaks to
DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2}
_WHAT = "paged attention C kernel"
ISA_NAMES = {0: "baseline", 1: "avx2", 2: "avx512"}
# Multiply-adds (keys x query heads x head dim) below which one call runs on one thread: tens of
# microseconds of work, less than waking the others costs (batch 1 at short contexts).
MIN_PARALLEL_WORK = 1 << 20

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: KernelUnavailable | None = None


class _Batch(ctypes.Structure):
    _fields_ = [("row_start", ctypes.c_void_p), ("q_len", ctypes.c_void_p),
                ("ctx_len", ctypes.c_void_p), ("tables", ctypes.c_void_p),
                ("table_stride", ctypes.c_int64), ("nseq", ctypes.c_int64),
                ("n_heads", ctypes.c_int64), ("n_kv_heads", ctypes.c_int64),
                ("head_dim", ctypes.c_int64), ("block_size", ctypes.c_int64),
                ("max_q", ctypes.c_int64), ("split", ctypes.c_int64),
                ("min_parallel_work", ctypes.c_int64), ("max_isa", ctypes.c_int64),
                ("scale", ctypes.c_float), ("nthreads", ctypes.c_int32)]


_ERRORS = {1: "unsupported dtype", 2: "bad head or block sizes", 3: "a span's lengths do not fit "
           "its block table", 4: "out of memory"}


def cache_dir() -> Path:
    return cbuild.cache_dir("paged_attn")


def library_path(flags: tuple[str, ...] = FLAG_SETS[0]) -> Path:
    """Where the library for this source, compiler and flags lives (built or not)."""
    return cbuild.library_path(SOURCE, flags, "paged_attn", _WHAT, NoCompiler)


def _build(target: Path, flags: tuple[str, ...]) -> None:
    cbuild.build(SOURCE, target, flags, _WHAT, KernelUnavailable)


def _open(flags: tuple[str, ...]) -> ctypes.CDLL:
    return cbuild.load(SOURCE, flags, "paged_attn", _WHAT, KernelUnavailable, NoCompiler,
                       "pa_abi", ABI)


def _narrow(lib: ctypes.CDLL, flags: tuple[str, ...]) -> ctypes.CDLL:
    """On an AVX2 CPU without AVX-512, the build with 8-float vectors (`PA_VW` in the source): GCC
    compiles the default 16-float ones into slow code for AVX2. Keeps `lib` if that fails."""
    try:
        return _open(flags + ("-DPA_VW=8",))
    except (KernelUnavailable, OSError):
        return lib


def _load() -> ctypes.CDLL:
    global _lib, _error
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        if _error is not None:
            raise _error
        errors: list[KernelUnavailable] = []
        lib = None
        for flags in FLAG_SETS:
            try:
                lib = _open(flags)
                if lib.pa_isa() == 1:  # AVX2 without AVX-512
                    lib = _narrow(lib, flags)
                break
            except NoCompiler as exc:
                errors.append(exc)
                break  # other flags will not help
            except KernelUnavailable as exc:
                errors.append(exc)
            except OSError as exc:  # an unwritable cache dir
                errors.append(KernelUnavailable(f"paged attention C kernel: {exc}"))
        if lib is None:
            _error = errors[0] if len(errors) == 1 else KernelUnavailable(
                "\n".join(str(e) for e in errors))
            raise _error
        _lib = _typed(lib)
        return lib


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    ptr, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pa_decode.argtypes = [ctypes.c_int, ctypes.POINTER(_Batch), ptr, i64, ptr, ptr, ptr, i64]
    lib.pa_decode.restype = ctypes.c_int
    return lib


def library(vector_floats: int) -> ctypes.CDLL:
    """The library built with this vector width (16 or 8) and the first flag set, whatever this
    CPU would pick: tests run both builds on one machine by putting it in place of `_lib`."""
    extra = () if vector_floats == 16 else (f"-DPA_VW={vector_floats}",)
    return _typed(_open(FLAG_SETS[0] + extra))


def load() -> None:
    """Build and load the library now; raises `KernelUnavailable` if it cannot."""
    _load()


def available() -> bool:
    """Whether the kernel builds and loads here (the answer is remembered per process)."""
    try:
        _load()
    except KernelUnavailable:
        return False
    return True


def info() -> dict[str, object]:
    """What runs here: {"openmp": bool, "isa": "baseline" | "avx2" | "avx512",
    "vector_floats": 16 or 8}."""
    lib = _load()
    return {"openmp": bool(lib.pa_openmp()), "isa": ISA_NAMES.get(lib.pa_isa(), "?"),
            "vector_floats": int(lib.pa_vector_width())}


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether these tensors are ones the kernel takes (CPU, fp32 or bf16, same dtype)."""
    return (q.device.type == "cpu" and k_cache.device.type == "cpu" and q.dtype == k_cache.dtype
            and q.dtype in DTYPE_CODES)


class DecodeSpans:
    """One step's decode spans in the kernel's form; built once, used by every layer.

    rows[b], q_lens[b]: the flat-batch rows of sequence b's query span; ctx_lens[b]: the keys its
    last row sees; tables[b]: its block ids (at least ceil(ctx_len / block_size) of them)."""

    def __init__(self, rows: list[int], q_lens: list[int], ctx_lens: list[int],
                 tables: list[list[int]], block_size: int) -> None:
        n = len(rows)
        width = max(1, max(-(-c // block_size) for c in ctx_lens)) if n else 1
        flat = rows + q_lens + ctx_lens
        for tb in tables:
            row = tb[:width]
            flat.extend(row)
            if len(row) < width:
                flat.extend([0] * (width - len(row)))
        # One int32 tensor for all four arrays: one allocation per step.
        self.ints = torch.tensor(flat, dtype=torch.int32)
        self.nseq, self.width, self.block_size = n, width, block_size
        self.max_q = max(q_lens) if n else 1
        # Checked against each call's tensors: the kernel trusts every row and block id.
        self.rows_end = max((r + c for r, c in zip(rows, q_lens)), default=0)
        self.max_block = max(flat[3 * n:], default=0)
        self.min_value = min(flat, default=0)
        self._batch: _Batch | None = None
        self._key: tuple[int, ...] = ()

    def check(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              out: torch.Tensor, what: str, supported: bool, want: str) -> None:
        """Raise ValueError (naming `what` and the tensor) unless the tensors are `supported`
        (else: "want {want}") and of one dtype, q and out have contiguous head dims, the caches
        are contiguous [slots, Hkv, D], out is shaped as q, and every row and block id of the
        spans lies inside q and the cache: the kernels trust them."""
        if not supported or v_cache.dtype != q.dtype or out.dtype != q.dtype:
            raise ValueError(f"{what}: want {want} tensors of one dtype, got q {q.dtype}@"
                             f"{q.device}, k_cache {k_cache.dtype}@{k_cache.device}, v_cache "
                             f"{v_cache.dtype}, out {out.dtype}")
        for name, x in (("q", q), ("out", out)):
            if x.stride(2) != 1:
                raise ValueError(f"{what}: {name} needs a contiguous head dim, got strides "
                                 f"{x.stride()}")
        t, _, d = q.shape
        hkv = k_cache.shape[1]
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if not x.is_contiguous() or x.shape[1:] != (hkv, d):
                raise ValueError(f"{what}: {name} must be a contiguous [slots, {hkv}, {d}] "
                                 f"tensor, got {tuple(x.shape)}")
        if out.shape != q.shape:
            raise ValueError(f"{what}: out is {tuple(out.shape)}, want {tuple(q.shape)}")
        if self.rows_end > t or self.min_value < 0:
            raise ValueError(f"{what}: spans reach row {self.rows_end} of {t} or hold a "
                             f"negative value")
        if (self.max_block + 1) * self.block_size > k_cache.shape[0]:
            raise ValueError(f"{what}: block {self.max_block} is past the cache's "
                             f"{k_cache.shape[0] // self.block_size} blocks")

    def batch(self, n_heads: int, n_kv_heads: int, head_dim: int, threads: int,
              split: int = 0, min_parallel_work: int = MIN_PARALLEL_WORK,
              max_isa: int = max(ISA_NAMES)) -> _Batch:
        key = (n_heads, n_kv_heads, head_dim, threads, split, min_parallel_work, max_isa)
        if self._batch is None or key != self._key:
            base, step = self.ints.data_ptr(), self.ints.element_size()
            n = self.nseq
            self._batch = _Batch(base, base + n * step, base + 2 * n * step, base + 3 * n * step,
                                 self.width, n, n_heads, n_kv_heads, head_dim, self.block_size,
                                 self.max_q, split, min_parallel_work, max_isa,
                                 1.0 / math.sqrt(head_dim), threads)
            self._key = key
        return self._batch


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           spans: DecodeSpans, threads: int | None = None, split: int = 0,
           min_parallel_work: int = MIN_PARALLEL_WORK, max_isa: int = max(ISA_NAMES)) -> None:
    """Attention of the spans' rows of q [T, H, D] over the paged cache [slots, Hkv, D] into the
    same rows of out [T, H, D]; other rows of out are left alone. `threads`: default
    torch.get_num_threads(); `split` (chunks per sequence, 0: the kernel picks),
    `min_parallel_work` and `max_isa` (the widest build to use, of ISA_NAMES) are for tests."""
    lib = _load()
    spans.check(q, k_cache, v_cache, out, _WHAT, supports(q, k_cache), "CPU fp32/bf16")
    _, h, d = q.shape
    hkv = k_cache.shape[1]
    for name, x in (("q", q), ("out", out)):
        if x.stride(1) != d:  # the kernel steps from head to head by d
            raise ValueError(f"{_WHAT}: {name} must have contiguous heads, got strides "
                             f"{x.stride()}")
    if threads is None:
        threads = torch.get_num_threads()
    bt = spans.batch(h, hkv, d, threads, split, min_parallel_work, max_isa)
    rc = lib.pa_decode(DTYPE_CODES[q.dtype], ctypes.byref(bt), q.data_ptr(), q.stride(0),
                       k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), out.stride(0))
    if rc != 0:
        raise RuntimeError(f"paged attention C kernel: {_ERRORS.get(rc, f'error {rc}')} "
                           f"(q {tuple(q.shape)}, cache {tuple(k_cache.shape)})")
