"""The CUDA side of attention: the Triton decode kernel's selection and fallback, SDPA prefill.

Owns whether a step's decode runs the Triton kernel of `paged_attn_triton` (`use_triton`, given
the `PDSERVE_PAGED_ATTN` mode `attention` reads), importing that module only when it may run
(Triton is optional, and importing it early would compile what the CPU suite's interpreter
tests need interpreted), the switch to the reference for the rest of the process when the
kernel's first launch fails in "auto" mode, the kernel's line in `describe_decode_path`, and one
prefill chunk's attention on CUDA through SDPA's flash/efficient kernels (`prefill_sdpa`). It
must not hold the reference math (`attention` does) or decide which blocks a sequence owns.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from pdserve.engine.attention import DecodeBatch

log = logging.getLogger(__name__)
_error: TritonUnavailable | None = None
_warned = False


class TritonUnavailable(RuntimeError):
    """The Triton kernel cannot run here: Triton is missing, or its first launch failed."""


def load():
    """The Triton kernel's module; raises TritonUnavailable (remembered) when it cannot run."""
    global _error
    if _error is not None:
        raise _error
    try:
        from pdserve.engine import paged_attn_triton
    except ImportError as exc:
        _error = TritonUnavailable(f"paged attention Triton kernel: cannot import triton: {exc}")
        raise _error from exc
    return paged_attn_triton


def use_triton(q: torch.Tensor, k_cache: torch.Tensor, mode: str) -> bool:
    """Whether decode attention on these tensors runs the Triton kernel: CUDA tensors of fp32,
    bf16 or fp16 in "auto" and "triton" modes; CPU tensors only in "triton" mode under the
    interpreter. "triton" mode raises when the kernel cannot run here."""
    global _warned
    if mode in ("torch", "c") or (mode == "auto" and q.device.type != "cuda"):
        return False
    try:
        pat = load()
    except TritonUnavailable as exc:
        if mode == "triton":
            raise
        if not _warned:
            _warned = True
            log.warning("%s; decode attention uses the PyTorch reference", exc)
        return False
    ok = pat.supports(q, k_cache) and (q.device.type == "cuda" or pat.INTERPRETED)
    if mode == "triton" and not ok:
        raise ValueError(f"PDSERVE_PAGED_ATTN=triton: the Triton kernel takes fp32/bf16/fp16 "
                         f"CUDA tensors (CPU ones only under TRITON_INTERPRET=1), got {q.dtype} "
                         f"on {q.device.type}")
    return ok


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
           d: DecodeBatch, mode: str) -> bool:
    """The Triton kernel on `d`'s rows; False when, in "auto" mode, its launch failed (no
    compiler for this GPU, a Triton too old for it): the caller then runs the reference, and so
    does every later step of this process (with one warning)."""
    global _error
    try:
        load().decode(q, k_cache, v_cache, out, d.triton_meta())
        return True
    except Exception as exc:  # compile and launch errors share no type across Triton versions
        if mode != "auto" or isinstance(exc, (ValueError, TritonUnavailable)):
            raise
        _error = TritonUnavailable(f"paged attention Triton kernel failed: {exc!r}")
        log.warning("%s; decode attention uses the PyTorch reference", _error)
        return False


def describe(dtype: torch.dtype, device: torch.device, mode: str) -> dict[str, object]:
    """`describe_decode_path` for CUDA (or "triton" mode): {"mode", "path", "triton" | "reason"}."""
    probe = torch.empty(0, dtype=dtype, device=device)
    try:
        if use_triton(probe, probe, mode):
            import triton
            return {"mode": mode, "path": "triton", "triton": triton.__version__}
    except (TritonUnavailable, ValueError) as exc:
        return {"mode": mode, "path": "torch", "reason": str(exc)}
    if _error is not None:
        return {"mode": mode, "path": "torch", "reason": str(_error)}
    return {"mode": mode, "path": "torch", "reason": f"the Triton kernel takes fp32/bf16/fp16 "
                                                     f"on CUDA, not {dtype} on {device.type}"}


def prefill_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill chunk on CUDA: q [1, H, Lq, D] over k/v [1, Hkv, Lk, D], causal with the last
    Lq keys being the chunk's own -> [1, H, Lq, D]. A bool mask tensor keeps SDPA off its
    flash/efficient kernels, so the offset causal mask is the bottom-right causal bias instead,
    and the kv heads are repeated to the query heads (those kernels' GQA support varies across
    torch versions). `mask` ([Lq, Lk] bool) is used only where torch lacks the bias."""
    g = q.shape[1] // k.shape[1]
    if g > 1:
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    lq, lk = q.shape[2], k.shape[2]
    if lq == lk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    try:  # torch >= 2.3. Imported here: it imports triton, which CPU runs must not load early
        from torch.nn.attention.bias import causal_lower_right
    except ImportError:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, lk))
