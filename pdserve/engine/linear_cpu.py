"""The C linear kernel for fp32 on CPU (`linear_c.c`): build, load, pack, call.

Owns building and loading `linear_c.c` (through `cbuild`, as the paged-attention kernel:
compiled on first use into `$PDSERVE_CACHE/linear/`, with OpenMP when the compiler has it, on
the `libgomp` torch already loaded), packing a weight into the kernel's panels once, and calling
it through ctypes on CPU fp32 tensors with `torch.get_num_threads()` threads. `linear.py`
decides when it runs. It must not hold or choose weights.

The kernel needs AVX-512F or AVX2 with FMA (`isa()`); `available()` is False (with the reason
in `unavailable_reason()`) on other CPUs, without a compiler, or when the build fails, and the
caller keeps its other path.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pdserve.engine import cbuild
from pdserve.engine.cbuild import KernelUnavailable, NoCompiler  # noqa: F401 - re-exported

SOURCE = Path(__file__).with_name("linear_c.c")
BASE_FLAGS = ("-O3", "-std=gnu99", "-ffp-contract=fast", "-shared", "-fPIC")
FLAG_SETS = (BASE_FLAGS + ("-fopenmp",), BASE_FLAGS)
ABI = 2
_WHAT = "linear C kernel"


def _declare(lib) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.sg_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.sg_linear.restype = ctypes.c_int


_kernel = cbuild.FirstUse(SOURCE, FLAG_SETS, "linear", _WHAT, KernelUnavailable, NoCompiler,
                          "lc_abi", ABI, "lc_supported", _declare)
available = _kernel.available
unavailable_reason = _kernel.unavailable_reason
isa = _kernel.isa  # the instruction set the kernel runs on here: "avx512f" or "avx2"


def panel_width() -> int:
    return int(_kernel.require().lc_nr())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` [N, K] (fp32, CPU) as the kernel's panels [ceil(N/NR), K, NR], zero past N."""
    n, k = weight.shape
    nr = panel_width()
    panels = -(-n // nr)
    padded = torch.zeros(panels * nr, k, dtype=torch.float32)
    padded[:n] = weight
    return padded.view(panels, nr, k).transpose(1, 2).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp32, CPU) times the packed weight: [..., out_features]."""
    lib = _kernel.get()
    assert lib is not None, "check available() first"
    k = packed.shape[1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, out_features, dtype=torch.float32)
    if m:
        rc = lib.sg_linear(x2.data_ptr(), m, k, packed.data_ptr(), out_features, y.data_ptr(),
                           torch.get_num_threads())
        if rc != 0:
            raise KernelUnavailable(f"{_WHAT}: sg_linear returned {rc}")
    if bias is not None:
        y += bias
    return y.view(*lead, out_features)
