"""Triton kernels of the anchor/residual KV codec: split, join and dequantize-anchor.

Owns the GPU path of the format that `kvcodec` defines and checks against; the planes these
kernels write are byte-identical to the PyTorch reference's. Callers go through `kvcodec` (which
validates sizes); this module must not define format rules of its own.
The kernels read and write the floats through integer views (int32 for fp32, int16 for bf16 and
fp16), so no float operation ever touches a value and NaN payloads survive. On CPU they run under
`TRITON_INTERPRET=1` (set before this module is imported: `triton.jit` reads it at decoration).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pdserve.engine.kvcodec import GROUP_SIZE, MAX_DELTA, MAX_GAP, RAW_HEADER, ZERO_EXT

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
# dtype -> (total bits, mantissa bits, residual bytes per value); mirrors kvcodec._LAYOUT.
_LAYOUT = {torch.float32: (32, 23, 3), torch.bfloat16: (16, 7, 1), torch.float16: (16, 10, 1)}
_BLOCK_GROUPS = 32  # groups per program: 1024 values
_BLOCK = 1024  # values per program, fp16


@triton.jit
def _split_grouped(x_ptr, anchor_ptr, res_ptr, n, ngroups,
                   WIDTH: tl.constexpr, MBITS: tl.constexpr, RBYTES: tl.constexpr,
                   G: tl.constexpr, BG: tl.constexpr, MAXD: tl.constexpr, ZEXT: tl.constexpr,
                   GAP: tl.constexpr, RAW: tl.constexpr):
    RB: tl.constexpr = MBITS - 4
    grp = tl.program_id(0).to(tl.int64) * BG + tl.arange(0, BG)
    offs = grp[:, None] * G + tl.arange(0, G)[None, :]
    inb = offs < n
    g = tl.load(x_ptr + offs, mask=inb, other=0).to(tl.int32)  # tail padded with +0
    if WIDTH == 16:
        g = g & 0xFFFF
    e = (g >> MBITS) & 0xFF
    big_e = tl.max(e, axis=1)
    gap = tl.max(tl.where(e > 0, big_e[:, None] - e, 0), axis=1)
    normal = (big_e < RAW) & (gap <= GAP)
    d = big_e[:, None] - e
    a_norm = ((g >> (WIDTH - 8)) & 0x80) | (tl.minimum(d, MAXD) << 4) | ((g >> RB) & 0xF)
    ext = tl.where((e == 0) & (d >= MAXD), ZEXT, tl.maximum(d - MAXD, 0))
    r_norm = (ext << RB) | (g & ((1 << RB) - 1))
    a_raw = (g >> (WIDTH - 8)) & 0xFF
    r_raw = g & ((1 << (WIDTH - 8)) - 1)
    a = tl.where(normal[:, None], a_norm, a_raw)
    r = tl.where(normal[:, None], r_norm, r_raw)
    tl.store(anchor_ptr + grp, tl.where(normal, big_e, RAW).to(tl.uint8), mask=grp < ngroups)
    tl.store(anchor_ptr + ngroups + offs, a.to(tl.uint8), mask=inb)
    for k in tl.static_range(RBYTES):
        tl.store(res_ptr + k * n + offs, ((r >> (8 * k)) & 0xFF).to(tl.uint8), mask=inb)


@triton.jit
def _join_grouped(anchor_ptr, res_ptr, out_ptr, n, ngroups,
                  WIDTH: tl.constexpr, MBITS: tl.constexpr, RBYTES: tl.constexpr,
                  G: tl.constexpr, BLOCK: tl.constexpr, MAXD: tl.constexpr, ZEXT: tl.constexpr,
                  RAW: tl.constexpr):
    RB: tl.constexpr = MBITS - 4
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    header = tl.load(anchor_ptr + offs // G, mask=inb, other=0).to(tl.int32)
    a = tl.load(anchor_ptr + ngroups + offs, mask=inb, other=0).to(tl.int32)
    r = tl.zeros([BLOCK], dtype=tl.int32)
    for k in tl.static_range(RBYTES):
        r = r | (tl.load(res_ptr + k * n + offs, mask=inb, other=0).to(tl.int32) << (8 * k))
    ext = r >> RB  # 0 unless the anchor's delta is 7
    e = tl.where(ext == ZEXT, 0, header - ((a >> 4) & 7) - ext)
    # int32 shifts wrap: the sign lands in bit 31 for fp32, bit 15 for the 16-bit store.
    b_norm = ((a & 0x80) << (WIDTH - 8)) | (e << MBITS) | ((a & 0xF) << RB) | (r & ((1 << RB) - 1))
    b_raw = (a << (WIDTH - 8)) | r
    bits = tl.where(header == RAW, b_raw, b_norm)
    tl.store(out_ptr + offs, bits.to(out_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _dequant_grouped(anchor_ptr, out_ptr, n, ngroups,
                     WIDTH: tl.constexpr, MBITS: tl.constexpr, G: tl.constexpr,
                     BLOCK: tl.constexpr, MAXD: tl.constexpr, RAW: tl.constexpr):
    RB: tl.constexpr = MBITS - 4
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    header = tl.load(anchor_ptr + offs // G, mask=inb, other=0).to(tl.int32)
    a = tl.load(anchor_ptr + ngroups + offs, mask=inb, other=0).to(tl.int32)
    sign = (a & 0x80) << (WIDTH - 8)
    dc = (a >> 4) & 7
    e = header - dc
    mid = tl.where(e > 0, 1 << (RB - 1), 0)
    b_norm = tl.where(dc < MAXD, sign | (tl.maximum(e, 0) << MBITS) | ((a & 0xF) << RB) | mid, sign)
    hi7 = a & 0x7F
    b_raw = tl.where(hi7 == 0, sign,
                     tl.where(hi7 == 0x7F, sign | (0xFF << MBITS), (a << (WIDTH - 8)) | (1 << MBITS)))
    bits = tl.where(header == RAW, b_raw, b_norm)
    tl.store(out_ptr + offs, bits.to(out_ptr.dtype.element_ty), mask=inb)


@triton.jit
def _split_f16(x_ptr, anchor_ptr, res_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    b = tl.load(x_ptr + offs, mask=inb, other=0).to(tl.int32) & 0xFFFF
    tl.store(anchor_ptr + offs, (b >> 8).to(tl.uint8), mask=inb)
    tl.store(res_ptr + offs, (b & 0xFF).to(tl.uint8), mask=inb)


@triton.jit
def _join_f16(anchor_ptr, res_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    a = tl.load(anchor_ptr + offs, mask=inb, other=0).to(tl.int32)
    r = tl.load(res_ptr + offs, mask=inb, other=0).to(tl.int32)
    tl.store(out_ptr + offs, ((a << 8) | r).to(tl.int16), mask=inb)


@triton.jit
def _dequant_f16(anchor_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    a = tl.load(anchor_ptr + offs, mask=inb, other=0).to(tl.int32)
    exp5 = (a >> 2) & 0x1F
    mid = tl.where((exp5 > 0) & (exp5 < 0x1F), 0x80, 0)
    tl.store(out_ptr + offs, ((a << 8) | mid).to(tl.int16), mask=inb)


def _grid(n: int, per_program: int) -> tuple[int]:
    return (max(1, -(-n // per_program)),)


def _consts(dtype: torch.dtype) -> dict:
    width, mbits, _ = _LAYOUT[dtype]
    return dict(WIDTH=width, MBITS=mbits, G=GROUP_SIZE, MAXD=MAX_DELTA, RAW=RAW_HEADER)


def split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    bits = x.reshape(-1).view(_INT_VIEW[x.dtype])
    rbytes = _LAYOUT[x.dtype][2]
    if x.dtype == torch.float16:
        anchor = torch.empty(n, dtype=torch.uint8, device=x.device)
        residual = torch.empty(n, dtype=torch.uint8, device=x.device)
        if n:
            _split_f16[_grid(n, _BLOCK)](bits, anchor, residual, n, BLOCK=_BLOCK)
        return anchor, residual
    ngroups = -(-n // GROUP_SIZE)
    anchor = torch.empty(ngroups + n, dtype=torch.uint8, device=x.device)
    residual = torch.empty(rbytes * n, dtype=torch.uint8, device=x.device)
    if n:
        _split_grouped[_grid(ngroups, _BLOCK_GROUPS)](
            bits, anchor, residual, n, ngroups, RBYTES=rbytes, BG=_BLOCK_GROUPS, ZEXT=ZERO_EXT,
            GAP=MAX_GAP, **_consts(x.dtype))
    return anchor, residual


def join(anchor: torch.Tensor, residual: torch.Tensor, dtype: torch.dtype,
         shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    out = torch.empty(n, dtype=_INT_VIEW[dtype], device=anchor.device)
    if n and dtype == torch.float16:
        _join_f16[_grid(n, _BLOCK)](anchor, residual, out, n, BLOCK=_BLOCK)
    elif n:
        _join_grouped[_grid(n, _BLOCK)](anchor, residual, out, n, anchor.numel() - n,
                                        RBYTES=_LAYOUT[dtype][2], BLOCK=_BLOCK, ZEXT=ZERO_EXT,
                                        **_consts(dtype))
    return out.view(dtype).reshape(shape)


def dequantize_anchor(anchor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    out = torch.empty(n, dtype=_INT_VIEW[dtype], device=anchor.device)
    if n and dtype == torch.float16:
        _dequant_f16[_grid(n, _BLOCK)](anchor, out, n, BLOCK=_BLOCK)
    elif n:
        _dequant_grouped[_grid(n, _BLOCK)](anchor, out, n, anchor.numel() - n, BLOCK=_BLOCK,
                                           **_consts(dtype))
    return out.view(dtype).reshape(shape)
