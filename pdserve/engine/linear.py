"""Linear layers with weights pre-packed once, at load, for the CPU's kernels.

Owns how a weight matrix is multiplied. On CPU (fp32/bf16, PyTorch built with oneDNN) weights
are reordered once into oneDNN's blocked layout: a plain `F.linear` re-packs the weight on every
call, which at decode batch sizes costs more than the arithmetic (the 30 layers of SmolLM2 at
batch 32: 48 ms plain, 22 ms packed, with 2 threads). fp32 on CPUs with AVX-512F or AVX2+FMA
runs our C kernel instead (`linear_cpu.py`, `linear_c.c`, its own panel layout): at decode batch
sizes it streams the weights near the memory bandwidth (SmolLM2's 121 matrices at batch 8, 2
threads: 18 ms against oneDNN's 26 ms with AVX-512; 31 against 45 ms on an AVX2-only CPU).
Elsewhere (CUDA, fp16, no oneDNN) it is `F.linear` unchanged.
`PDSERVE_LINEAR` picks a path: `c`, `onednn` or `reference` (plain `F.linear`); unset or `auto`
means the C kernel where it runs, else oneDNN where it can pack, else plain. The paths differ
only in summation order (about 1e-6 relative in fp32).
`quantization="int8"` (opt-in, CPU fp32 only) quantizes the weight once, here, to int8 per
output channel and multiplies through `linear_int8.py`: a quarter of the weight bytes, at a
cost in accuracy that `pdserve bench quant` measures. It never changes the fp32 paths.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# The packing is tuned for a batch size; measured here, a hint of 32 was faster than 1 even
# for batch-1 decode and does not constrain the batch sizes it accepts.
_PACK_HINT_ROWS = 32


def _forced() -> str:
    return os.environ.get("PDSERVE_LINEAR", "").strip().lower()


def c_kernel_available(dtype: torch.dtype, device: torch.device) -> bool:
    """The C kernel runs for this weight: not overridden (`PDSERVE_LINEAR` unset, `auto` or
    `c`), fp32 on CPU, and it builds and loads on this CPU (AVX-512F or AVX2+FMA)."""
    if (_forced() not in ("", "auto", "c")
            or not (device.type == "cpu" and dtype == torch.float32)):
        return False
    from pdserve.engine import linear_cpu

    return linear_cpu.available()


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    if _forced() == "reference":
        return False
    if not (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    # oneDNN packs bf16 only on CPUs with AVX512-BW/VL/DQ or AVX-NE-CONVERT; elsewhere the
    # reorder raises, so bf16 takes the plain path there.
    return dtype != torch.bfloat16 or _bf16_packing_supported()


def _bf16_packing_supported() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(check()) if check is not None else False


class Linear:
    """y = x @ W.T + b, with W packed once when the platform allows."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 pack: bool | None = None, quantization: str = "none") -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self.kind = "plain"
        if quantization == "int8":
            from pdserve.engine import linear_int8

            if not (weight.device.type == "cpu" and weight.dtype == torch.float32):
                raise ValueError(f"int8 linear layers need an fp32 weight on the CPU, got "
                                 f"{weight.dtype} on {weight.device}")
            self.kind = "int8"
            self.weight = linear_int8.pack(weight)
            self.nbytes = self.weight.nbytes
            self._int8_linear = linear_int8.linear
        elif quantization != "none":
            raise ValueError(f"quantization must be none or int8, got {quantization!r}")
        elif pack is not False and c_kernel_available(weight.dtype, weight.device):
            from pdserve.engine import linear_cpu

            self.kind = "c"
            self.weight = linear_cpu.pack(weight)
            self._c_linear = linear_cpu.linear
        elif packing_available(weight.dtype, weight.device) if pack is None else pack:
            self.kind = "onednn"
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                  _PACK_HINT_ROWS)
        else:
            self.weight = weight
        self.packed = self.kind != "plain"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "c":
            return self._c_linear(x, self.weight, self.out_features, self.bias)
        if self.kind == "int8":
            return self._int8_linear(x, self.weight, self.bias)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
