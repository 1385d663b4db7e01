"""Paged KV storage and the PyTorch reference attention over it.

Owns the cache tensors (one flat slot axis per layer: slot = block_id * block_size + offset) and
the attention math on them. It is the reference every later kernel (Triton, CUDA) is checked
against, so it favours clarity; it still batches all decode tokens into one SDPA call because at
batch 32 a per-sequence loop would cost more than the attention itself.
It must not decide which blocks a sequence owns: the block pool does that.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    """A sequence that runs more than one query token this step (a prefill chunk)."""

    q_start: int  # offset of its first token in the flat batch
    q_len: int
    ctx_len: int  # tokens of KV it attends to, this chunk's included
    gather: torch.Tensor | None  # [ctx_len] slots of its context; None: no earlier context
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, causal with the cached prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    prefills: list[PrefillSpan] = field(default_factory=list)
    decode_idx: torch.Tensor | None = None  # [B] rows of the flat batch that are single-token decodes
    decode_tables: torch.Tensor | None = None  # [B, nblk] block ids of each context (padded with 0)
    decode_len: int = 0  # Lmax, the longest decode context
    block_size: int = 16
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] bool, or None if no padding


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
    row = 0
    for computed, n_new, table in seqs:
        ctx_len = computed + n_new
        slots.extend(_slots(table, computed, ctx_len, block_size))
        if n_new == 1 and computed > 0:
            dec_rows.append(row)
            dec_tables.append(table)
            dec_lens.append(ctx_len)
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
        # Whole blocks are gathered (runs of block_size slots), not single slots: fewer, larger
        # copies, and no per-token index tensor to build.
        lmax = max(dec_lens)
        nblk = (lmax + block_size - 1) // block_size
        tables = torch.zeros(len(dec_rows), nblk, dtype=torch.long)
        for i, tb in enumerate(dec_tables):
            n = min(len(tb), nblk)
            tables[i, :n] = torch.tensor(tb[:n], dtype=torch.long)
        mask = None
        if min(dec_lens) != lmax:
            lens = torch.tensor(dec_lens, dtype=torch.long)
            valid = torch.arange(lmax).unsqueeze(0) < lens.unsqueeze(1)
            mask = valid.view(len(dec_rows), 1, 1, lmax).to(device)
        meta.decode_idx = torch.tensor(dec_rows, dtype=torch.long, device=device)
        meta.decode_tables = tables.to(device)
        meta.decode_len = lmax
        meta.decode_mask = mask
    return meta


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


def paged_attention(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata) -> torch.Tensor:
    """q [T, H, D]; k_new/v_new [T, Hkv, D] (already written to the cache) -> [T, H, D]."""
    out = torch.empty_like(q)
    # SDPA takes its fused (flash) CPU path only for 4-D inputs; 3-D ones fall back to the math
    # path, which materialises every score and is several times slower on long prompts.
    for p in meta.prefills:
        qs = q[p.q_start: p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
        if p.gather is None:
            ks = k_new[p.q_start: p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            vs = v_new[p.q_start: p.q_start + p.q_len].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        else:
            ks = k_cache[p.gather].transpose(0, 1).unsqueeze(0)
            vs = v_cache[p.gather].transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, enable_gqa=True)
        out[p.q_start: p.q_start + p.q_len] = o[0].transpose(0, 1)
    if meta.decode_idx is not None:
        kd = _gather_blocks(k_cache, meta.decode_tables, meta.block_size, meta.decode_len)
        vd = _gather_blocks(v_cache, meta.decode_tables, meta.block_size, meta.decode_len)
        # One query token per sequence: the query heads that share a KV head become the rows
        # of one [group, D] query against it, which is exact and cheaper than enable_gqa.
        b, kvh = kd.shape[0], kd.shape[1]
        qd = q[meta.decode_idx].view(b, kvh, -1, q.shape[-1])  # [B, Hkv, H/Hkv, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
        out[meta.decode_idx] = o.reshape(b, -1, q.shape[-1])
    return out


class PagedKVCache:
    """K and V for every layer, addressed by slot; blocks are contiguous runs of slots."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[i], self.v[i]

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
