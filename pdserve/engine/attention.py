"""Paged KV storage and the PyTorch reference attention over it.

Owns the cache tensors (one flat slot axis per layer: slot = block_id * block_size + offset),
the attention metadata of a step, and the attention math on them. The PyTorch path is the
reference every kernel is checked against, so it favours clarity; it still batches all decode
tokens into one SDPA call over block-gathered KV because at batch 32 a per-sequence loop would
cost more than the attention itself. Decode attention on CPU (fp32/bf16) runs the C kernel of
`paged_attn_cpu` instead, and on CUDA the Triton kernel of `paged_attn_triton`; both read the
blocks in place; `PDSERVE_PAGED_ATTN` picks (`attention_mode`, `decode_path`). Prefill chunks on
CUDA go to SDPA's flash/efficient kernels with a bottom-right causal bias instead of a mask tensor
(`attention_cuda`); on CPU they keep the path above. It must not decide which blocks a sequence
owns: the block pool does that.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.engine import attention_cuda, paged_attn_cpu

log = logging.getLogger(__name__)


@dataclass
class PrefillSpan:
    """A sequence that runs more than one query token this step (a prefill chunk)."""

    q_start: int  # offset of its first token in the flat batch
    q_len: int
    ctx_len: int  # tokens of KV it attends to, this chunk's included
    gather: torch.Tensor | None  # [ctx_len] slots of its context; None: no earlier context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, causal with the cached prefix


@dataclass
class DecodeBatch:
    """The decodes of one step: sequences with cached context running at most SHORT_SPAN query
    tokens (one, or one plus drafts to verify). Sequence b's queries are the flat-batch rows
    rows[b] .. rows[b] + q_lens[b] - 1; its last one sees ctx_lens[b] keys, through tables[b].
    The kernel's and the reference's tensors are built on first use (once per step, not per
    layer), so a step pays only for the path it takes."""

    rows: list[int]
    q_lens: list[int]
    ctx_lens: list[int]
    tables: list[list[int]]
    block_size: int
    device: torch.device
    _spans: paged_attn_cpu.DecodeSpans | None = field(default=None, repr=False)
    _ref: _ReferenceDecode | None = field(default=None, repr=False)
    _triton: object | None = field(default=None, repr=False)  # paged_attn_triton.DecodeMeta
    # Which decode attention this step runs ("c", "triton", "torch"): decided at the first layer
    # (every layer has the same dtype and device), so the others skip the check.
    path: str | None = None

    def spans(self) -> paged_attn_cpu.DecodeSpans:
        if self._spans is None:
            self._spans = paged_attn_cpu.DecodeSpans(self.rows, self.q_lens, self.ctx_lens,
                                                     self.tables, self.block_size)
        return self._spans

    def triton_meta(self):
        if self._triton is None:
            from pdserve.engine import paged_attn_triton
            self._triton = paged_attn_triton.DecodeMeta(self.spans(), self.device)
        return self._triton

    def reference(self) -> _ReferenceDecode:
        if self._ref is None:
            self._ref = _reference_decode_meta(self)
        return self._ref


@dataclass
class _ReferenceDecode:
    """The reference's padded form. Each sequence has Q query slots (the longest span); a
    shorter span's spare slots repeat its last row and are dropped."""

    idx: torch.Tensor  # [B * Q] rows of the flat batch, slot by slot
    tables: torch.Tensor  # [B, nblk] block ids of each context (padded with 0)
    length: int  # Lmax, the longest decode context
    mask: torch.Tensor | None  # [B, 1, 1, Lmax] or [B, Q, Lmax] bool; None: no padding
    q: int = 1  # Q, query slots per decode
    keep: torch.Tensor | None = None  # [B * Q] bool: real slots (None when Q == 1)
    out: torch.Tensor | None = None  # rows of the flat batch the real slots fill


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode: DecodeBatch | None = None
    block_size: int = 16

    @property
    def decode_idx(self) -> torch.Tensor | None:
        """The reference's decode rows (None without decodes)."""
        return None if self.decode is None else self.decode.reference().idx


# Speculative verification runs 1 + gamma tokens per sequence; up to this many query tokens on
# top of a cached context go through the batched decode attention instead of one call each.
SHORT_SPAN = 16


def _slots(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, end)]


def build_attention_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int,
                             device: torch.device) -> AttentionMetadata:
    """Build metadata from (num_computed_before, num_new, block_table) per sequence, in batch order."""
    slots: list[int] = []
    prefills: list[PrefillSpan] = []
    dec_rows: list[int] = []
    dec_tables: list[list[int]] = []
    dec_lens: list[int] = []
    dec_q: list[int] = []
    row = 0
    for computed, n_new, table in seqs:
        ctx_len = computed + n_new
        if n_new == 1:
            slots.append(table[computed // block_size] * block_size + computed % block_size)
        else:
            slots.extend(_slots(table, computed, ctx_len, block_size))
        if computed > 0 and n_new <= SHORT_SPAN:
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lens.append(ctx_len)
            dec_q.append(n_new)
        elif computed == 0:
            prefills.append(PrefillSpan(row, n_new, ctx_len, None, None))
        else:
            q_pos = torch.arange(computed, ctx_len, device=device).unsqueeze(1)
            k_pos = torch.arange(ctx_len, device=device).unsqueeze(0)
            gather = torch.tensor(_slots(table, 0, ctx_len, block_size), dtype=torch.long)
            prefills.append(PrefillSpan(row, n_new, ctx_len, gather.to(device), k_pos <= q_pos))
        row += n_new
    meta = AttentionMetadata(torch.tensor(slots, dtype=torch.long, device=device), prefills,
                             block_size=block_size)
    if dec_rows:
        meta.decode = DecodeBatch(dec_rows, dec_q, dec_lens, dec_tables, block_size, device)
    return meta


def _reference_decode_meta(d: DecodeBatch) -> _ReferenceDecode:
    device, block_size = d.device, d.block_size
    # Whole blocks are gathered (runs of block_size slots), not single slots: fewer, larger
    # copies, and no per-token index tensor to build.
    lmax = max(d.ctx_lens)
    nblk = (lmax + block_size - 1) // block_size
    tables = torch.tensor([tb[:nblk] + [0] * (nblk - len(tb[:nblk])) for tb in d.tables],
                          dtype=torch.long)
    lens = torch.tensor(d.ctx_lens, dtype=torch.long)
    b = len(d.rows)
    qmax = max(d.q_lens)
    if qmax == 1:
        mask = None
        if min(d.ctx_lens) != lmax:
            valid = torch.arange(lmax).unsqueeze(0) < lens.unsqueeze(1)
            mask = valid.view(b, 1, 1, lmax).to(device)
        return _ReferenceDecode(torch.tensor(d.rows, dtype=torch.long, device=device),
                                tables.to(device), lmax, mask)
    # Slot i of a span of q tokens sees keys up to position (ctx_len - q) + i; spare slots
    # (i >= q) repeat slot q - 1.
    q = torch.tensor(d.q_lens, dtype=torch.long)
    i = torch.minimum(torch.arange(qmax).unsqueeze(0), (q - 1).unsqueeze(1))  # [B, Q]
    rows = torch.tensor(d.rows, dtype=torch.long).unsqueeze(1) + i
    last = (lens - q).unsqueeze(1) + i  # [B, Q] last visible key position
    mask = (torch.arange(lmax).view(1, 1, lmax) <= last.unsqueeze(2)).to(device)
    keep = (torch.arange(qmax).unsqueeze(0) < q.unsqueeze(1)).flatten()
    return _ReferenceDecode(rows.flatten().to(device), tables.to(device), lmax, mask, qmax,
                            keep.to(device), rows.flatten()[keep].to(device))


MODES = ("auto", "c", "torch", "triton")
_warned = False


def attention_mode() -> str:
    """`PDSERVE_PAGED_ATTN`: "auto" (the C kernel on CPU and the Triton kernel on CUDA where they
    build and apply, else the reference), "c" (the C kernel on CPU, an error if it cannot be
    built), "triton" (the Triton kernel, an error if Triton is missing; on CPU only under
    TRITON_INTERPRET=1), "torch" (the reference)."""
    mode = os.environ.get("PDSERVE_PAGED_ATTN", "").strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"PDSERVE_PAGED_ATTN must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def use_kernel(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether decode attention on these tensors runs the C kernel (fp32/bf16 on CPU)."""
    global _warned
    mode = attention_mode()
    if mode in ("torch", "triton") or not paged_attn_cpu.supports(q, k_cache):
        return False
    if mode == "c":
        paged_attn_cpu.load()  # raises KernelUnavailable, saying why
        return True
    if paged_attn_cpu.available():
        return True
    if not _warned:
        _warned = True
        try:
            paged_attn_cpu.load()
        except paged_attn_cpu.KernelUnavailable as exc:
            log.warning("%s; decode attention uses the PyTorch reference", exc)
    return False


def decode_path(q: torch.Tensor, k_cache: torch.Tensor) -> str:
    """The decode attention these tensors get: "c", "triton" or "torch" (the reference)."""
    if attention_cuda.use_triton(q, k_cache, attention_mode()):
        return "triton"
    return "c" if use_kernel(q, k_cache) else "torch"


def describe_decode_path(dtype: torch.dtype, device: torch.device) -> dict[str, object]:
    """Which decode attention a cache of this dtype and device gets, for reports:
    {"mode", "path": "c" | "triton" | "torch", and the C kernel's "isa" and "openmp", the Triton
    kernel's "triton" version, or "reason"}."""
    mode = attention_mode()
    probe = torch.empty(0, dtype=dtype, device=device)
    if mode == "torch":
        return {"mode": mode, "path": "torch", "reason": "PDSERVE_PAGED_ATTN=torch"}
    if device.type == "cuda" or mode == "triton":
        return attention_cuda.describe(dtype, device, mode)
    if not paged_attn_cpu.supports(probe, probe):
        return {"mode": mode, "path": "torch", "reason": f"the kernel takes fp32/bf16 on CPU, "
                                                         f"not {dtype} on {device.type}"}
    try:
        return {"mode": mode, "path": "c", **paged_attn_cpu.info()}
    except paged_attn_cpu.KernelUnavailable as exc:
        return {"mode": mode, "path": "torch", "reason": str(exc)}


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def _gather_blocks(cache: torch.Tensor, tables: torch.Tensor, block_size: int,
                   length: int) -> torch.Tensor:
    """[slots, Hkv, D] cache and [B, nblk] block ids -> [B, Hkv, length, D] (a strided view)."""
    b, nblk = tables.shape
    blocks = cache.view(-1, block_size, cache.shape[1], cache.shape[2])[tables]
    return blocks.view(b, nblk * block_size, cache.shape[1], cache.shape[2])[:, :length].transpose(1, 2)


def _reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      out: torch.Tensor, r: _ReferenceDecode, block_size: int) -> None:
    kd = _gather_blocks(k_cache, r.tables, block_size, r.length)
    vd = _gather_blocks(v_cache, r.tables, block_size, r.length)
    # The query heads that share a KV head (times the query slots) become the rows of one
    # [group * Q, D] query against it, which is exact and cheaper than enable_gqa.
    b, kvh, d = kd.shape[0], kd.shape[1], q.shape[-1]
    nq = r.q
    if nq == 1:
        qd = q[r.idx].view(b, kvh, -1, d)  # [B, Hkv, H/Hkv, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=r.mask)
        out[r.idx] = o.reshape(b, -1, d)
    else:
        g = q.shape[1] // kvh
        qd = (q[r.idx].view(b, nq, kvh, g, d).permute(0, 2, 3, 1, 4)
              .reshape(b, kvh, g * nq, d))
        mask = r.mask.unsqueeze(1).unsqueeze(1).expand(b, 1, g, nq, -1).reshape(b, 1, g * nq, -1)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
        o = o.view(b, kvh, g, nq, d).permute(0, 3, 1, 2, 4).reshape(b * nq, kvh * g, d)
        out[r.out] = o[r.keep]


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D]; k_new/v_new [T, Hkv, D] (already written to the cache) -> [T, H, D]."""
    out = torch.empty_like(q)
    # SDPA takes its fused (flash) CPU path only for 4-D inputs; 3-D ones fall back to the math
    # path, which materialises every score and is several times slower on long prompts.
    cuda = q.device.type == "cuda"
    for p in meta.prefills:
        qs = q[p.q_start: p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
        if cuda:
            src_k, src_v = (k_new, v_new) if p.gather is None else (k_cache, v_cache)
            rows = slice(p.q_start, p.q_start + p.q_len) if p.gather is None else p.gather
            o = attention_cuda.prefill_sdpa(qs, src_k[rows].transpose(0, 1).unsqueeze(0),
                             src_v[rows].transpose(0, 1).unsqueeze(0), p.mask)
        elif p.gather is None:
            ks = k_new[p.q_start: p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            vs = v_new[p.q_start: p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ks = k_cache[p.gather].transpose(0, 1).unsqueeze(0)
            vs = v_cache[p.gather].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, enable_gqa=True)
        out[p.q_start: p.q_start + p.q_len] = o[0].transpose(0, 1)
    d = meta.decode
    if d is not None:
        if d.path is None:
            d.path = decode_path(q, k_cache)
        if d.path == "c":
            paged_attn_cpu.decode(q, k_cache, v_cache, out, d.spans())
        elif d.path == "triton":
            if not attention_cuda.decode(q, k_cache, v_cache, out, d, attention_mode()):
                d.path = "torch"  # the kernel failed to launch: the reference from now on
                decode_reference(q, k_cache, v_cache, out, d)
        else:
            decode_reference(q, k_cache, v_cache, out, d)
    return out


def decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     out: torch.Tensor, d: DecodeBatch) -> None:
    """The reference decode attention of `d`'s rows of q into the same rows of out; the kernels'
    yardstick."""
    _reference_decode(q, k_cache, v_cache, out, d.reference(), d.block_size)


class PagedKVCache:
    """K and V for every layer, addressed by slot; blocks are contiguous runs of slots."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Build the decode kernel now (a second or two, once per machine) rather than in the
        # first step; `use_kernel` reports a failure.
        q = torch.empty(0, dtype=dtype, device=device)
        if attention_mode() != "torch":
            decode_path(q, self.k)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

    def read_slots(self, layer: int, slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one layer's K and V at these cache slots (block * block_size + offset)."""
        index = torch.tensor(slots, dtype=torch.long, device=self.k.device)
        return self.k[layer].index_select(0, index), self.v[layer].index_select(0, index)

    def block_shape(self) -> tuple[int, ...]:
        """Shape of one exported block: [layers, 2 (k, v), block_size, kv_heads, head_dim]."""
        return (self.k.shape[0], 2, self.block_size, self.k.shape[2], self.k.shape[3])

    def read_block(self, block_id: int) -> torch.Tensor:
        s = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        return torch.stack((self.k[:, s], self.v[:, s]), dim=1).contiguous()

    def write_block(self, block_id: int, data: torch.Tensor) -> None:
        s = slice(block_id * self.block_size, (block_id + 1) * self.block_size)
        self.k[:, s] = data[:, 0]
        self.v[:, s] = data[:, 1]
