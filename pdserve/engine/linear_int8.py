"""int8 weight-only linear layers on CPU: quantize once, pack, and call `linear_int8_c.c`.

Owns the quantization rule (symmetric, per output channel: scale = max|row| / 127, values
rounded to [-127, 127]), its exact inverse for references (`dequantize`), building and loading
`linear_int8_c.c` (through `cbuild`, compiled on first use into `$PDSERVE_CACHE/linear_int8/`,
with OpenMP on the `libgomp` torch already loaded), packing the int8 weight into the kernel's
panels once, and calling it through ctypes with `torch.get_num_threads()` threads. Activations
and outputs stay fp32. Where the kernel cannot run (no compiler, neither AVX-512F nor AVX2+FMA)
`linear` falls back to `torch.ops.aten._weight_int8pack_mm`, which computes the same product but
was 4 to 100 times slower than the fp32 kernel at decode batch sizes here.
`linear.py` decides when this runs. Must not choose which weights are quantized: `model.py` does.
"""

from __future__ import annotations

import ctypes
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.engine import cbuild
from pdserve.engine.cbuild import KernelUnavailable, NoCompiler  # noqa: F401 - re-exported

SOURCE = Path(__file__).with_name("linear_int8_c.c")
BASE_FLAGS = ("-O3", "-std=gnu99", "-ffp-contract=fast", "-shared", "-fPIC")
FLAG_SETS = (BASE_FLAGS + ("-fopenmp",), BASE_FLAGS)
ABI = 1
ISAS = {"avx2": 1, "avx512f": 2}
_WHAT = "int8 linear C kernel"


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], fp32 scales [N]) of an fp32 weight [N, K]; an all-zero row has scale 0."""
    w = weight.float()
    scales = w.abs().amax(dim=1) / 127.0
    q = torch.round(w / scales.clamp_min(torch.finfo(torch.float32).tiny)[:, None])
    return q.clamp_(-127, 127).to(torch.int8).contiguous(), scales.contiguous()


def dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The fp32 weight the int8 one stands for: q * scale per row."""
    return q.float() * scales[:, None]


def _declare(lib) -> None:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.li8_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.li8_linear.restype = ctypes.c_int


_kernel = cbuild.FirstUse(SOURCE, FLAG_SETS, "linear_int8", _WHAT, KernelUnavailable,
                          NoCompiler, "li8_abi", ABI, "li8_supported", _declare)
available = _kernel.available
unavailable_reason = _kernel.unavailable_reason
isa = _kernel.isa  # the instruction set the kernel picks here: "avx512f" or "avx2"


@dataclass(frozen=True)
class PackedInt8:
    """An int8 weight ready for the kernel: panels [ceil(N/NR), K, NR] and scales padded to
    the panels (zero past N); `q`/`scales` unpacked when the kernel cannot run."""

    data: torch.Tensor
    scales: torch.Tensor
    out_features: int
    isa: int  # 1 AVX2, 2 AVX-512F; 0: not packed (the torch fallback)

    @property
    def nbytes(self) -> int:
        n, k = self.out_features, self.data.shape[-2 if self.isa else -1]
        return n * k + 4 * n


def pack(weight: torch.Tensor, isa_name: str | None = None) -> PackedInt8:
    """Quantize an fp32 weight [N, K] and lay it out for the kernel (`isa_name` forces one
    instruction set, for tests; None: the best here, or the torch fallback's layout)."""
    q, scales = quantize(weight)
    n, k = q.shape
    lib = _kernel.get()
    if lib is None:
        return PackedInt8(q, scales, n, 0)
    code = ISAS[isa_name] if isa_name else int(lib.li8_supported())
    nr = int(lib.li8_nr(code))
    panels = -(-n // nr)
    padded = torch.zeros(panels * nr, k, dtype=torch.int8)
    padded[:n] = q
    padded_scales = torch.zeros(panels * nr, dtype=torch.float32)
    padded_scales[:n] = scales
    return PackedInt8(padded.view(panels, nr, k).transpose(1, 2).contiguous(), padded_scales,
                      n, code)


def unpack(w: PackedInt8) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [N, K], scales [N]) of a packed weight: what it multiplies by, for references."""
    if not w.isa:
        return w.data, w.scales
    panels, k, nr = w.data.shape
    q = w.data.transpose(1, 2).reshape(panels * nr, k)[:w.out_features]
    return q.contiguous(), w.scales[:w.out_features].contiguous()


_warned = False


def linear(x: torch.Tensor, w: PackedInt8, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (fp32, CPU) times the int8 weight, scaled per output: [..., out_features]."""
    global _warned
    n = w.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if not w.isa:
        if not _warned:
            _warned = True
            warnings.warn(f"{unavailable_reason()}; int8 linear layers run on "
                          f"torch's _weight_int8pack_mm, much slower", RuntimeWarning,
                          stacklevel=2)
        y = torch.ops.aten._weight_int8pack_mm(x2, w.data, w.scales)
    else:
        lib = _kernel.get()
        assert lib is not None
        m, k = x2.shape
        y = torch.empty(m, n, dtype=torch.float32)
        if m:
            rc = lib.li8_linear(x2.data_ptr(), m, k, w.data.data_ptr(), w.scales.data_ptr(), n,
                                y.data_ptr(), torch.get_num_threads(), w.isa)
            if rc != 0:
                raise KernelUnavailable(f"{_WHAT}: li8_linear returned {rc}")
    if bias is not None:
        y += bias
    return y.view(*lead, n)
