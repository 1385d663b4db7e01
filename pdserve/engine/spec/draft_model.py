"""Trained drafters that read the target's hidden states: EAGLE-, DFlash- and DSpark-style.

Owns the drafter network (`DraftNet`, one small design shared by the three kinds), its
checkpoint format (`draft.safetensors` + `config.json`), and `ModelDrafter`, the `Drafter` the
engine calls. It must not run the target or touch the engine's state: the engine hands it the
target's hidden states in each `DraftRequest`.

The network: the input at a window row is `fc(cat(rms(emb(token)), rms(hidden)))`; one pre-norm
decoder layer (RoPE on window-relative positions, SwiGLU) turns it into a predicted hidden state,
which goes through the target's final norm and a reduced LM head (`target.lm_head_weight[d2t]`,
EAGLE-3's draft vocabulary). Embeddings, final norm and head rows come from the target and are
never saved.

- eagle: serial; the last window row predicts the last token's hidden state, which (with the
  drafted token) becomes the next row; the window's K/V are kept, so a step computes one row.
- dflash: one forward for a block of `gamma` slots after the window (slot 0 holds the last token,
  the rest learned mask tokens), bidirectional inside the block.
- dspark: dflash plus a low-rank Markov head on the previously drafted token and a confidence
  head (the probability that the draft is accepted given the previous ones were).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.core.draft_config import (CONFIG_FILE, FORMAT_VERSION, KINDS, WEIGHTS_FILE,  # noqa: F401
                                       DraftConfig, read_draft_config, read_draft_kind)
from pdserve.engine.spec.base import Draft, Drafter, DraftRequest

class SharedTarget:
    """The target's tensors a drafter reuses (fp32): embedding, final norm, head rows, RoPE."""

    def __init__(self, target, d2t: torch.Tensor) -> None:
        self.embed = target.embed.float()
        self.norm = target.norm.float()
        self.eps = target.cfg.rms_norm_eps
        self.d2t = d2t.long()
        self.head = target.lm_head_weight.float()[self.d2t].contiguous()  # [Vd, d]
        self.cos = target.cos.float()
        self.sin = target.sin.float()


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class DraftNet(nn.Module):
    """The trainable part; `shared` is the target's (frozen, never saved)."""

    def __init__(self, cfg: DraftConfig, shared: SharedTarget) -> None:
        super().__init__()
        self.cfg = cfg
        self.shared = shared
        d, hq = cfg.hidden_size, cfg.num_heads * cfg.head_dim
        self.emb_norm = nn.Parameter(torch.ones(d))
        self.hid_norm = nn.Parameter(torch.ones(d))
        self.fc = nn.Linear(2 * d, d, bias=False)
        self.in_norm = nn.Parameter(torch.ones(d))
        self.qkv = nn.Linear(d, 3 * hq, bias=False)
        self.o = nn.Linear(hq, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_up = nn.Linear(d, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, d, bias=False)
        if cfg.kind in ("dflash", "dspark"):
            self.mask_hidden = nn.Parameter(torch.randn(d) * 0.02)
            self.mask_tokens = nn.Parameter(torch.randn(max(cfg.gamma - 1, 0), d) * 0.02)
        if cfg.kind == "dspark":
            self.markov_down = nn.Linear(d, cfg.markov_rank, bias=False)
            self.markov_up = nn.Linear(cfg.markov_rank, d, bias=False)
            nn.init.zeros_(self.markov_up.weight)  # starts as plain dflash
            self.conf = nn.Linear(d, 1)
        for lin in (self.fc, self.qkv, self.o, self.gate_up, self.down):
            nn.init.normal_(lin.weight, std=0.02)

    # ---- pieces shared by training and inference ------------------------------------------
    def fuse(self, hidden: torch.Tensor, tok_emb: torch.Tensor) -> torch.Tensor:
        eps = self.shared.eps
        return self.fc(torch.cat([_rms(tok_emb, self.emb_norm, eps),
                                  _rms(hidden, self.hid_norm, eps)], dim=-1))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.shared.embed)

    def qkv_at(self, x: torch.Tensor, pos: torch.Tensor):
        """x [B, L, d], pos [B, L] -> q, k, v [B, H, L, hd] with RoPE applied."""
        b, n, _ = x.shape
        h, hd = self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self.qkv(_rms(x, self.in_norm, self.shared.eps)).view(b, n, 3, h, hd).unbind(2)
        cos = self.shared.cos[pos].unsqueeze(2)
        sin = self.shared.sin[pos].unsqueeze(2)
        return (_rope(q, cos, sin).transpose(1, 2), _rope(k, cos, sin).transpose(1, 2),
                v.transpose(1, 2))

    def finish(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """Attention of queries q over keys k/v (mask [B, Lq, Lk] bool) plus the MLP: the output."""
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.unsqueeze(1))
        h = x + self.o(a.transpose(1, 2).flatten(2))
        gate, up = self.gate_up(_rms(h, self.post_norm, self.shared.eps)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Reduced-vocabulary logits [.., Vd] of predicted hidden states."""
        return _rms(out, self.shared.norm, self.shared.eps) @ self.shared.head.T

    def markov(self, out: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        return out + self.markov_up(F.silu(self.markov_down(self.embed(prev))))

    def block_inputs(self, last: torch.Tensor) -> torch.Tensor:
        """dflash/dspark block slot inputs [B, gamma, d] for last tokens [B]."""
        b = last.shape[0]
        mh = self.mask_hidden.expand(b, 1, -1)
        slot0 = self.fuse(mh, self.embed(last).unsqueeze(1))
        if self.cfg.gamma == 1:
            return slot0
        rest = self.fuse(self.mask_hidden.expand(b, self.cfg.gamma - 1, -1),
                         self.mask_tokens.expand(b, -1, -1))
        return torch.cat([slot0, rest], dim=1)


class ModelDrafter(Drafter):
    """Batched proposals from a `DraftNet`; windows are left-padded and masked."""

    needs_hidden = True

    def __init__(self, net: DraftNet) -> None:
        self.net = net.eval()
        self.cfg = net.cfg
        self.window = net.cfg.window
        self.has_confidence = net.cfg.kind == "dspark"
        self.device = net.shared.embed.device

    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = [Draft([], [] if self.cfg.kind == "dspark" else None) for _ in requests]
        live = [i for i, r in enumerate(requests)
                if r.k > 0 and r.hidden is not None and r.hidden.shape[0] > 0 and r.token_ids]
        if not live:
            return out
        reqs = [requests[i] for i in live]
        net, d, dev = self.net, self.cfg.hidden_size, self.device
        ws = [min(r.hidden.shape[0], self.window) for r in reqs]
        b, wmax = len(reqs), max(ws)
        hid = torch.zeros(b, wmax, d, device=dev)
        toks = torch.zeros(b, wmax, dtype=torch.long)
        valid = torch.zeros(b, wmax, dtype=torch.bool)
        for i, (r, w) in enumerate(zip(reqs, ws)):
            hid[i, wmax - w:] = r.hidden[-w:].to(device=dev, dtype=torch.float32)
            toks[i, wmax - w:] = torch.tensor(r.token_ids[len(r.token_ids) - w:], dtype=torch.long)
            valid[i, wmax - w:] = True
        pad = torch.tensor([wmax - w for w in ws]).unsqueeze(1)
        pos = (torch.arange(wmax).unsqueeze(0) - pad).clamp(min=0).to(dev)  # window-relative
        toks, valid = toks.to(dev), valid.to(dev)
        x = net.fuse(hid, net.embed(toks))
        _, k, v = net.qkv_at(x, pos)
        last = torch.tensor([r.token_ids[-1] for r in reqs], dtype=torch.long, device=dev)
        kmax = max(r.k for r in reqs)
        wlen = torch.tensor(ws, device=dev).unsqueeze(1)
        if self.cfg.kind == "eagle":
            tokens, conf = self._serial(x[:, -1:], k, v, valid, wlen, kmax)
        else:
            tokens, conf = self._block(k, v, valid, wlen, last, min(kmax, self.cfg.gamma))
        tokens = net.shared.d2t[tokens].cpu()
        conf = conf.cpu() if conf is not None else None
        for j, (i, r) in enumerate(zip(live, reqs)):
            n = min(r.k, tokens.shape[1])
            out[i] = Draft(tokens[j, :n].tolist(),
                           conf[j, :n].tolist() if conf is not None else None)
        return out

    def _serial(self, x_last, k, v, valid, wlen, steps):
        """EAGLE: the last window row's output is draft 1; each draft and its predicted hidden
        state become the next row (one new K/V row per step)."""
        net = self.net
        b = x_last.shape[0]
        q, _, _ = net.qkv_at(x_last, (wlen - 1))
        keymask = valid.clone()
        x = x_last
        drafts = []
        for s in range(steps):
            o = net.finish(x, q, k, v, keymask.unsqueeze(1))
            tok = net.logits(o[:, 0]).argmax(-1)
            drafts.append(tok)
            if s + 1 == steps:
                break
            x = net.fuse(o, net.embed(net.shared.d2t[tok]).unsqueeze(1))
            q, k1, v1 = net.qkv_at(x, wlen + s)
            k = torch.cat([k, k1], dim=2)
            v = torch.cat([v, v1], dim=2)
            keymask = torch.cat([keymask, keymask.new_ones(b, 1)], dim=1)
        return torch.stack(drafts, dim=1), None

    def _block(self, k, v, valid, wlen, last, n):
        """DFlash/DSpark: all gamma slots in one forward; DSpark then walks its Markov head."""
        net = self.net
        b, g = last.shape[0], self.cfg.gamma
        xb = net.block_inputs(last)
        qb, kb, vb = net.qkv_at(xb, wlen + torch.arange(g, device=wlen.device).unsqueeze(0))
        mask = torch.cat([valid, valid.new_ones(b, g)], dim=1).unsqueeze(1)
        o = net.finish(xb, qb, torch.cat([k, kb], 2), torch.cat([v, vb], 2), mask.expand(-1, g, -1))
        if self.cfg.kind == "dflash":
            return net.logits(o[:, :n]).argmax(-1), None
        prev = last
        toks, confs = [], []
        for j in range(n):
            oj = net.markov(o[:, j], prev)
            tok = net.logits(oj).argmax(-1)
            toks.append(tok)
            confs.append(torch.sigmoid(net.conf(oj)[:, 0]))
            prev = net.shared.d2t[tok]
        return torch.stack(toks, 1), torch.stack(confs, 1)


# ---- checkpoints ------------------------------------------------------------------------------
def draft_config_for(target, kind: str, **overrides: Any) -> DraftConfig:
    """A DraftConfig sized for `target` (a LlamaModel); `overrides` replace defaults."""
    c = target.cfg
    base = dict(kind=kind, target_name=c.name, hidden_size=c.hidden_size,
                num_heads=c.num_attention_heads, head_dim=c.head_dim,
                intermediate_size=2 * c.hidden_size)
    base.update({k: v for k, v in overrides.items() if v is not None})
    base["draft_vocab_size"] = min(base.get("draft_vocab_size", 8192), c.vocab_size)
    return DraftConfig(**base)


def save_drafter(net: DraftNet, out_dir: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    tensors["d2t"] = net.shared.d2t.clone()
    save_file(tensors, os.path.join(out_dir, WEIGHTS_FILE))
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(asdict(net.cfg), f, indent=2)


def load_draft_net(path: str, target, expect_kind: str | None = None) -> DraftNet:
    from safetensors.torch import load_file

    cfg = read_draft_config(path)
    if expect_kind is not None and cfg.kind != expect_kind:
        raise ValueError(f"{path}: drafter kind is {cfg.kind!r}, spec.method asks for "
                         f"{expect_kind!r}")
    tc = target.cfg
    if (cfg.hidden_size, cfg.num_heads, cfg.head_dim) != (
            tc.hidden_size, tc.num_attention_heads, tc.head_dim):
        raise ValueError(f"{path}: drafter was trained for hidden_size {cfg.hidden_size}, "
                         f"{cfg.num_heads} heads of {cfg.head_dim}; the target has "
                         f"{tc.hidden_size}, {tc.num_attention_heads} of {tc.head_dim}")
    if cfg.target_name != tc.name:
        raise ValueError(f"{path}: drafter was trained for target {cfg.target_name!r}, "
                         f"not {tc.name!r}")
    tensors = load_file(os.path.join(path, WEIGHTS_FILE))
    d2t = tensors.pop("d2t")
    if d2t.numel() != cfg.draft_vocab_size or int(d2t.max()) >= tc.vocab_size:
        raise ValueError(f"{path}: draft vocabulary does not fit the target's {tc.vocab_size}")
    net = DraftNet(cfg, SharedTarget(target, d2t.to(target.device)))
    net.load_state_dict(tensors)
    return net.to(target.device).eval()


def load_drafter(path: str, target, expect_kind: str | None = None) -> ModelDrafter:
    """The drafter saved in `path` for `target` (a LlamaModel); ValueError if it does not fit."""
    return ModelDrafter(load_draft_net(path, target, expect_kind))
