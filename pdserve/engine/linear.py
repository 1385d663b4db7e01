"""Linear layers with weights pre-packed for the CPU's GEMM kernels.

Owns how a weight matrix is multiplied. On CPU (fp32/bf16, PyTorch built with oneDNN) weights
are reordered once, at load, into oneDNN's blocked layout: a plain `F.linear` re-packs the
weight on every call, which at decode batch sizes costs more than the arithmetic (measured here:
the 30 layers of SmolLM2 at batch 32 take 48 ms with the best plain layout, 22 ms packed; at
batch 1, 25 ms vs 11 ms). Elsewhere (CUDA, fp16, no oneDNN) it is `F.linear` unchanged.
Packed and plain results differ only in summation order (about 1e-6 relative in fp32).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# The packing is tuned for a batch size; measured here, a hint of 32 was faster than 1 even
# for batch-1 decode and does not constrain the batch sizes it accepts.
_PACK_HINT_ROWS = 32


def packing_available(dtype: torch.dtype, device: torch.device) -> bool:
    if os.environ.get("PDSERVE_LINEAR", "") == "reference":
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
                 pack: bool | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.nbytes = weight.numel() * weight.element_size()
        self.packed = packing_available(weight.dtype, weight.device) if pack is None else pack
        if self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                  _PACK_HINT_ROWS)
        else:
            self.weight = weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)
