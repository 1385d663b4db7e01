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
    # Decodes: sequences with cached context running at most SHORT_SPAN tokens (one, or one
    # plus drafts to verify), attended in one batched call. Each has Q query slots (the longest
    # span); a shorter span's spare slots repeat its last row and are dropped.
    decode_idx: torch.Tensor | None = None  # [B * Q] rows of the flat batch, slot by slot
    decode_tables: torch.Tensor | None = None  # [B, nblk] block ids of each context (padded with 0)
    decode_len: int = 0  # Lmax, the longest decode context
    block_size: int = 16
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] or [B, Q, Lmax] bool; None: no padding
    decode_q: int = 1  # Q, query slots per decode
    decode_keep: torch.Tensor | None = None  # [B * Q] bool: real slots (None when Q == 1)
    decode_out: torch.Tensor | None = None  # rows of the flat batch the real slots fill


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
        # Whole blocks are gathered (runs of block_size slots), not single slots: fewer, larger
        # copies, and no per-token index tensor to build.
        lmax = max(dec_lens)
        nblk = (lmax + block_size - 1) // block_size
        tables = torch.zeros(len(dec_rows), nblk, dtype=torch.long)
        for i, tb in enumerate(dec_tables):
            n = min(len(tb), nblk)
            tables[i, :n] = torch.tensor(tb[:n], dtype=torch.long)
        mask = None
        lens = torch.tensor(dec_lens, dtype=torch.long)
        qmax = max(dec_q)
        if qmax == 1:
            if min(dec_lens) != lmax:
                valid = torch.arange(lmax).unsqueeze(0) < lens.unsqueeze(1)
                mask = valid.view(len(dec_rows), 1, 1, lmax).to(device)
            meta.decode_idx = torch.tensor(dec_rows, dtype=torch.long, device=device)
        else:
            # Slot i of a span of q tokens sees keys up to position (ctx_len - q) + i; spare
            # slots (i >= q) repeat slot q - 1.
            q = torch.tensor(dec_q, dtype=torch.long)
            i = torch.minimum(torch.arange(qmax).unsqueeze(0), (q - 1).unsqueeze(1))  # [B, Q]
            rows = torch.tensor(dec_rows, dtype=torch.long).unsqueeze(1) + i
            last = (lens - q).unsqueeze(1) + i  # [B, Q] last visible key position
            mask = (torch.arange(lmax).view(1, 1, lmax) <= last.unsqueeze(2)).to(device)
            keep = (torch.arange(qmax).unsqueeze(0) < q.unsqueeze(1)).flatten()
            meta.decode_idx = rows.flatten().to(device)
            meta.decode_keep = keep.to(device)
            meta.decode_out = rows.flatten()[keep].to(device)
            meta.decode_q = qmax
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
        # The query heads that share a KV head (times the query slots) become the rows of one
        # [group * Q, D] query against it, which is exact and cheaper than enable_gqa.
        b, kvh, d = kd.shape[0], kd.shape[1], q.shape[-1]
        nq = meta.decode_q
        if nq == 1:
            qd = q[meta.decode_idx].view(b, kvh, -1, d)  # [B, Hkv, H/Hkv, D]
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask)
            out[meta.decode_idx] = o.reshape(b, -1, d)
        else:
            g = q.shape[1] // kvh
            qd = (q[meta.decode_idx].view(b, nq, kvh, g, d).permute(0, 2, 3, 1, 4)
                  .reshape(b, kvh, g * nq, d))
            mask = (meta.decode_mask.unsqueeze(1).unsqueeze(1).expand(b, 1, g, nq, -1)
                    .reshape(b, 1, g * nq, -1))
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask)
            o = o.view(b, kvh, g, nq, d).permute(0, 3, 1, 2, 4).reshape(b * nq, kvh * g, d)
            out[meta.decode_out] = o[meta.decode_keep]
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
