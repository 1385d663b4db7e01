"""Training the hidden-state drafters by self-distillation, and the `pdserve train-draft` command.

Owns the data (ShareGPT prompts answered greedily by the target, with the target's final hidden
state and argmax at every position), the fixed held-out split, the training loops of the three
kinds, the held-out acceptance estimate, and where default drafters live. It must not change the
engine: it runs the target's `LlamaModel.forward` on a scratch paged cache of its own.

Held-out split: a ShareGPT prompt is held out iff the first byte of sha256(prompt text) is < 32
(`is_held_out`, about 1/8 of prompts). Training never sees a held-out prompt; benchmarks draw
their evaluation prompts with `split_prompts(n, held_out=True)`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.engine.spec.draft_model import (KINDS, DraftNet, ModelDrafter, SharedTarget,
                                             draft_config_for, read_draft_config, save_drafter)
from pdserve.engine.spec.base import DraftRequest

# The documented defaults (`ensure_default_draft` trains with these).
DEFAULTS: dict[str, Any] = dict(num_prompts=192, num_held_out=24, max_new_tokens=96, epochs=4,
                                gamma=4, window=32, seed=0, lr=2e-3, draft_vocab_size=8192)
MAX_PROMPT_CHARS = 1000  # keeps the target's prefill (the data's cost) small


def is_held_out(prompt: str) -> bool:
    """The fixed evaluation split: never trained on."""
    return hashlib.sha256(prompt.encode("utf-8")).digest()[0] < 32


def split_prompts(n: int, *, held_out: bool, seed: int = 0,
                  max_chars: int = MAX_PROMPT_CHARS) -> list[str]:
    """`n` ShareGPT first turns from one side of the split, the same on every machine."""
    from pdserve.engine.prompts import load_sharegpt_prompts

    ask = max(4 * n, 64) if not held_out else max(12 * n, 256)
    while True:
        pool = load_sharegpt_prompts(ask, seed=seed, max_chars=max_chars)
        got = [p for p in pool if is_held_out(p) == held_out]
        if len(got) >= n:
            return got[:n]
        ask *= 2


@dataclass
class Sample:
    """One answered prompt: tokens [n] whose hidden states [n, d] are known; labels[i] is the
    target's argmax after position i (so tokens[i + 1] == labels[i] inside the answer)."""

    tokens: torch.Tensor
    hidden: torch.Tensor
    labels: torch.Tensor
    prompt_len: int


# ---- data -------------------------------------------------------------------------------------
@torch.inference_mode()
def answer_with_hidden(model, prompts: list[list[int]], max_new_tokens: int, eos_ids,
                       *, batch: int = 32, block_size: int = 16, progress=None) -> list[Sample]:
    """Greedy answers from the target (a LlamaModel), keeping every position's hidden state.

    One pass gives both the answers and the hidden states: a separate pass over prompt+answer
    would double the cost, which on a CPU is most of the training time."""
    from pdserve.engine.attention import PagedKVCache, build_attention_metadata
    from pdserve.engine.model import StepInput

    cfg, dev = model.cfg, model.device
    eos = set(eos_ids)
    out: list[Sample] = []
    task = progress.add_task("target answers", total=len(prompts)) if progress else None
    for s in range(0, len(prompts), batch):
        group = prompts[s:s + batch]
        nblk = -(-(max(map(len, group)) + max_new_tokens + 1) // block_size)
        kv = PagedKVCache(cfg.num_hidden_layers, nblk * len(group), block_size,
                          cfg.num_key_value_heads, cfg.head_dim, model.dtype, dev)
        tables = [list(range(i * nblk, (i + 1) * nblk)) for i in range(len(group))]
        toks = [list(p) for p in group]
        hids: list[list[torch.Tensor]] = [[] for _ in group]
        labs: list[list[int]] = [[] for _ in group]
        live = list(range(len(group)))
        computed = [0] * len(group)
        for step in range(max_new_tokens + 1):
            ids, pos, meta = [], [], []
            for i in live:
                new = toks[i][computed[i]:]
                ids.extend(new)
                pos.extend(range(computed[i], len(toks[i])))
                meta.append((computed[i], len(new), tables[i]))
            step_in = StepInput(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev),
                                build_attention_metadata(meta, block_size, dev))
            h = model.forward(step_in, kv)
            ends = torch.tensor([m[1] for m in meta]).cumsum(0) - 1
            nxt = model.compute_logits(h[ends.to(dev)]).argmax(-1).tolist()
            row, still = 0, []
            for i, (_, n_new, _), t in zip(live, meta, nxt):
                hids[i].append(h[row:row + n_new].float().cpu())
                labs[i].extend(model.compute_logits(h[row:row + n_new - 1]).argmax(-1).tolist()
                               if n_new > 1 else [])
                labs[i].append(t)
                row += n_new
                computed[i] = len(toks[i])
                if t in eos or step == max_new_tokens:
                    continue  # the sequence ends; its last label is this token
                toks[i].append(t)
                still.append(i)
            live = still
            if not live:
                break
        for i, p in enumerate(group):
            n = computed[i]
            out.append(Sample(torch.tensor(toks[i][:n]), torch.cat(hids[i])[:n],
                              torch.tensor(labs[i][:n]), len(p)))
        if progress:
            progress.advance(task, len(group))
    return out


def _render(tok, text: str) -> list[int]:
    if tok is not None and getattr(tok, "chat_template", None):
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                          add_special_tokens=False)
    return tok.encode(text)


def build_d2t(samples: list[Sample], vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: the most frequent target labels inside the answers (ties: lower id)."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        counts.index_add_(0, s.labels[max(s.prompt_len - 1, 0):],
                          torch.ones(len(s.labels) - max(s.prompt_len - 1, 0), dtype=torch.float64))
    order = torch.argsort(-counts - torch.arange(vocab_size) / (2.0 * vocab_size))
    return order[:min(draft_vocab_size, vocab_size)].sort().values


# ---- training ---------------------------------------------------------------------------------
def _pad(samples: list[Sample], d: int):
    n = max(len(s.tokens) for s in samples)
    b = len(samples)
    toks = torch.zeros(b, n + 8, dtype=torch.long)
    labs = torch.zeros(b, n + 8, dtype=torch.long)
    hid = torch.zeros(b, n + 8, d)
    for i, s in enumerate(samples):
        m = len(s.tokens)
        toks[i, :m], labs[i, :m], hid[i, :m] = s.tokens, s.labels, s.hidden
    return toks, labs, hid


def _noisy(h: torch.Tensor, std: float) -> torch.Tensor:
    return h + std * h.std(-1, keepdim=True) * torch.randn_like(h) if std > 0 else h


def eagle_loss(net: DraftNet, samples: list[Sample], t2d: torch.Tensor, *, steps: int = 2,
               noise: float = 0.2, feat_weight: float = 0.1) -> torch.Tensor:
    """CE to the target's labels plus feature regression, unrolled `steps` serial steps
    (training-time test: later steps read the features the earlier ones predicted)."""
    w, d = net.cfg.window, net.cfg.hidden_size
    toks, labs, hid = _pad(samples, d)
    lo = torch.zeros(len(samples), dtype=torch.long)
    nn_ = torch.tensor([len(s.tokens) for s in samples])
    length = int((nn_ - 1 - lo).max())
    r = torch.arange(length)
    idx = lo.unsqueeze(1) + r  # [B, L] absolute position i of each row
    valid = idx <= (nn_ - 2).unsqueeze(1)
    idx = torch.where(valid, idx, 0)
    scale = hid.pow(2).mean().sqrt()

    def g(t: torch.Tensor, off: int) -> torch.Tensor:  # t[b, idx + off] per row
        j = idx + off
        return t.gather(1, j if t.dim() == 2 else j.unsqueeze(-1).expand(-1, -1, d))

    near = (r.unsqueeze(1) >= r.unsqueeze(0)) & (r.unsqueeze(1) - r.unsqueeze(0) < w)
    base_mask = near.unsqueeze(0) & valid.unsqueeze(1)  # [B, Lq, Lk]
    x = net.fuse(_noisy(g(hid, 0), noise), net.embed(g(toks, 1)))
    q, k, v = net.qkv_at(x, idx)
    keys_k, keys_v, mask = k, v, base_mask
    eye = torch.eye(length, dtype=torch.bool).unsqueeze(0).expand(len(samples), -1, -1)
    total = torch.zeros(())
    for t in range(1, steps + 1):
        o = net.finish(x, q, keys_k, keys_v, mask)
        # Every position teaches: inside the prompt the labels are still the target's argmax
        # after the real context, which doubles the data the answers alone give.
        ok = valid & (idx + t <= (nn_ - 1).unsqueeze(1))
        tgt = t2d[g(labs, t)][ok]  # logits only where a loss is taken: the head is the cost
        total = total + F.cross_entropy(net.logits(o[ok]), tgt, ignore_index=-1)
        feat = F.smooth_l1_loss(o / scale, g(hid, t) / scale, reduction="none").mean(-1)
        total = total + feat_weight * (feat * ok).sum() / ok.sum().clamp(min=1)
        if t == steps:
            break
        x = net.fuse(o, net.embed(g(toks, t + 1)))
        q, k1, v1 = net.qkv_at(x, idx + t)
        keys_k = torch.cat([keys_k, k1], 2)
        keys_v = torch.cat([keys_v, v1], 2)
        mask = torch.cat([mask, eye], 2)
    return total / steps


def block_loss(net: DraftNet, samples: list[Sample], t2d: torch.Tensor, *, anchors: int = 48,
               noise: float = 0.2, gen: torch.Generator | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    """dflash/dspark: CE over the gamma slots of blocks anchored at answer positions (dspark adds
    the confidence head's BCE: is the draft the label, teacher-forced)."""
    w, d, gm = net.cfg.window, net.cfg.hidden_size, net.cfg.gamma
    toks, labs, hid = _pad(samples, d)
    b = len(samples)
    length = max(max(len(s.tokens) - 1 for s in samples), 1)
    cidx = torch.arange(length).unsqueeze(0).expand(b, -1)  # context rows q, absolute
    cvalid = cidx <= torch.tensor([len(s.tokens) - 2 for s in samples]).unsqueeze(1)
    cidx = torch.where(cvalid, cidx, 0)
    # anchors: the last-token position a, anywhere (the prompt's labels teach too)
    av, aidx = torch.zeros(b, anchors, dtype=torch.bool), torch.zeros(b, anchors, dtype=torch.long)
    for i, s in enumerate(samples):
        cand = torch.arange(1, len(s.tokens))
        if len(cand) > anchors:
            cand = cand[torch.randperm(len(cand), generator=gen)[:anchors]].sort().values
        aidx[i, :len(cand)], av[i, :len(cand)] = cand, True
    slot = aidx.unsqueeze(2) + torch.arange(gm)  # [B, A, G] positions a + j
    nlen = torch.tensor([len(s.tokens) for s in samples]).view(b, 1, 1)
    ok = av.unsqueeze(2) & (slot <= nlen - 1)
    slot_c = torch.where(ok, slot, 0)
    gh = hid.gather(1, cidx.unsqueeze(-1).expand(-1, -1, d))
    x = net.fuse(_noisy(gh, noise), net.embed(toks.gather(1, cidx + 1)))
    _, kc, vc = net.qkv_at(x, cidx)
    xb = net.block_inputs(toks.gather(1, aidx).flatten()).view(b, anchors * gm, d)
    qb, kb, vb = net.qkv_at(xb, slot_c.flatten(1))
    ap = aidx.repeat_interleave(gm, 1)  # [B, A*G] anchor of each query
    m_ctx = ((cidx.unsqueeze(1) < ap.unsqueeze(2)) & (cidx.unsqueeze(1) >= ap.unsqueeze(2) - w)
             & cvalid.unsqueeze(1))
    blk = torch.arange(anchors).repeat_interleave(gm)
    m_blk = (blk.unsqueeze(1) == blk.unsqueeze(0)).unsqueeze(0).expand(b, -1, -1)
    o = net.finish(xb, qb, torch.cat([kc, kb], 2), torch.cat([vc, vb], 2),
                   torch.cat([m_ctx, m_blk], 2))
    okf = ok.flatten(1)
    tgt = t2d[labs.gather(1, slot_c.flatten(1))][okf]
    o = o[okf]  # logits only where a loss is taken: the head is the cost
    if net.cfg.kind == "dspark":
        o = net.markov(o, toks.gather(1, slot_c.flatten(1))[okf])
    logits = net.logits(o)
    loss = F.cross_entropy(logits, tgt, ignore_index=-1)
    info = {"ce": float(loss.detach())}
    if net.cfg.kind == "dspark":
        hit = ((logits.argmax(-1) == tgt) & (tgt >= 0)).float()
        bce = F.binary_cross_entropy_with_logits(net.conf(o.detach())[:, 0], hit)
        loss = loss + bce
        info["bce"] = float(bce.detach())
    return loss, info


# ---- evaluation -------------------------------------------------------------------------------
def held_out_acceptance(drafter: ModelDrafter, samples: list[Sample], gamma: int) -> float:
    """Mean tokens per verification (accepted drafts + 1) when greedy decoding each held-out
    answer with `gamma` drafts: the target's labels play the verifier."""
    state = [max(s.prompt_len - 1, 0) for s in samples]  # position of the last token
    emitted = verifications = 0
    while True:
        live = [i for i, s in enumerate(samples) if state[i] + gamma <= len(s.tokens) - 1]
        if not live:
            break
        reqs = []
        for i in live:
            s, a = samples[i], state[i]
            lo = max(0, a - drafter.window)
            reqs.append(DraftRequest(s.tokens[:a + 1].tolist(), gamma, s.hidden[lo:a]))
        for i, dr in zip(live, drafter.propose(reqs)):
            s, a = samples[i], state[i]
            want = s.labels[a:a + gamma].tolist()
            m = 0
            while m < len(dr.tokens) and dr.tokens[m] == want[m]:
                m += 1
            emitted += m + 1
            verifications += 1
            state[i] = a + m + 1
    return emitted / max(verifications, 1)


# ---- the whole recipe -------------------------------------------------------------------------
def _progress(enabled: bool):
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, ProgressColumn,
                               TextColumn, TimeElapsedColumn)
    from rich.text import Text

    class Info(ProgressColumn):
        """A task's `info` field (the loss while training); a task without one shows none."""

        def render(self, task) -> Text:
            return Text(str(task.fields.get("info", "")))

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    Info(), TimeElapsedColumn(), disable=not enabled)


def cache_root() -> str:
    return os.environ.get("PDSERVE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                           "pdserve")


def _data(target_path: str, model, prompts_train: list[str], prompts_eval: list[str],
          max_new_tokens: int, progress, use_cache: bool):
    from pdserve.engine.tokenizer import Tokenizer

    key = hashlib.sha256(json.dumps([target_path, model.cfg.name, prompts_train, prompts_eval,
                                     max_new_tokens, 1]).encode()).hexdigest()[:16]
    path = os.path.join(cache_root(), "draft-data", f"{key}.pt")
    if use_cache and os.path.isfile(path):
        raw = torch.load(path)
        return [[Sample(**s) for s in part] for part in raw]
    try:
        tok = Tokenizer.from_path(target_path)
    except Exception:  # a test checkpoint without tokenizer files: raw prompts are ids below
        tok = None
    enc = (lambda t: _render(tok, t)) if tok is not None else (
        lambda t: [1 + (b % (model.cfg.vocab_size - 1)) for b in t.encode("utf-8")][:256])
    ids = [enc(p) for p in prompts_train + prompts_eval]
    samples = answer_with_hidden(model, ids, max_new_tokens, model.cfg.eos_token_ids,
                                 progress=progress)
    parts = [samples[:len(prompts_train)], samples[len(prompts_train):]]
    if use_cache:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch.save([[s.__dict__ for s in part] for part in parts], path + ".tmp")
        os.replace(path + ".tmp", path)
    return parts


def train_draft(target_path: str, kind: str, out_dir: str, *, num_prompts: int | None = None,
                num_held_out: int | None = None, max_new_tokens: int | None = None,
                epochs: int | None = None, gamma: int | None = None, window: int | None = None,
                seed: int | None = None, lr: float | None = None,
                draft_vocab_size: int | None = None, markov_rank: int | None = None,
                intermediate_size: int | None = None, batch_size: int = 8,
                prompts: list[str] | None = None, eval_prompts: list[str] | None = None,
                progress: bool = True, use_cache: bool = True) -> dict[str, Any]:
    """Self-distil a `kind` drafter for the target at `target_path`; save it in `out_dir`;
    return the stats written to its config.json. `prompts`/`eval_prompts` replace ShareGPT."""
    from pdserve.engine.loader import load_checkpoint
    from pdserve.engine.model import LlamaModel

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    o = {k: v for k, v in dict(num_prompts=num_prompts, num_held_out=num_held_out,
                               max_new_tokens=max_new_tokens, epochs=epochs, gamma=gamma,
                               window=window, seed=seed, lr=lr,
                               draft_vocab_size=draft_vocab_size).items() if v is not None}
    a = {**DEFAULTS, **o}
    t0 = time.perf_counter()
    torch.manual_seed(a["seed"])
    mcfg, weights = load_checkpoint(target_path, torch.float32)
    model = LlamaModel(mcfg, weights, dtype=torch.float32)
    del weights
    if prompts is None:
        prompts = split_prompts(a["num_prompts"], held_out=False, seed=a["seed"])
    if eval_prompts is None:
        eval_prompts = (split_prompts(a["num_held_out"], held_out=True, seed=a["seed"])
                        if a["num_held_out"] else [])
    with _progress(progress) as bar:
        train, held = _data(target_path, model, prompts, eval_prompts, a["max_new_tokens"], bar,
                            use_cache)
        t_data = time.perf_counter() - t0
        cfg = draft_config_for(model, kind, window=a["window"], gamma=a["gamma"],
                               draft_vocab_size=a["draft_vocab_size"], markov_rank=markov_rank,
                               intermediate_size=intermediate_size)
        d2t = build_d2t(train, mcfg.vocab_size, cfg.draft_vocab_size)
        t2d = torch.full((mcfg.vocab_size,), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(d2t.numel())
        net = DraftNet(cfg, SharedTarget(model, d2t))
        del model  # the drafter keeps only the shared tensors it needs
        opt = torch.optim.AdamW(net.parameters(), lr=a["lr"], weight_decay=0.01)
        gen = torch.Generator().manual_seed(a["seed"])
        per_epoch = -(-len(train) // batch_size)
        total_steps = per_epoch * a["epochs"]
        warm = max(1, min(20, total_steps // 10))
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (
            1 + math.cos(math.pi * min(s, total_steps) / max(total_steps, 1))))
        task = bar.add_task(f"train {kind}", total=total_steps, info="")
        losses: list[float] = []
        t1 = time.perf_counter()
        net.train()
        for _ in range(a["epochs"]):
            order = torch.randperm(len(train), generator=gen).tolist()
            for s in range(0, len(train), batch_size):
                batch = [train[i] for i in order[s:s + batch_size]]
                if kind == "eagle":
                    loss, info = eagle_loss(net, batch, t2d), {}
                else:
                    loss, info = block_loss(net, batch, t2d, gen=gen)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                sched.step()
                losses.append(float(loss.detach()))
                recent = losses[-10:]
                bar.update(task, advance=1, info=f"loss {sum(recent) / len(recent):.3f}")
        t_train = time.perf_counter() - t1
        net.eval()
        accept = held_out_acceptance(ModelDrafter(net), held, cfg.gamma) if held else None
    stats = {"held_out_acceptance_length": accept, "held_out_sequences": len(held),
             "train_sequences": len(train),
             "train_answer_tokens": sum(len(s.tokens) - s.prompt_len + 1 for s in train),
             "data_time_s": round(t_data, 1), "train_time_s": round(t_train, 1),
             "total_time_s": round(time.perf_counter() - t0, 1),
             "first_loss": losses[0] if losses else None,
             "final_loss": sum(losses[-5:]) / len(losses[-5:]) if losses else None,
             "settings": a}
    net.cfg.stats = stats
    save_drafter(net, out_dir)
    return stats


# ---- defaults and the command -----------------------------------------------------------------
def default_draft_dir(kind: str, target_path: str | None = None) -> str:
    """Where the default drafter of `kind` for the target (default: SmolLM2) lives."""
    from pdserve.engine.loader import default_model_path, load_model_config

    name = load_model_config(target_path or default_model_path()).name
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    return os.path.join(cache_root(), "drafts", f"{safe}-{kind}")


def ensure_default_draft(kind: str, target_path: str | None = None, progress: bool = True) -> str:
    """The default drafter's directory, trained with DEFAULTS first if it is not there."""
    from pdserve.engine.loader import default_model_path

    path = default_draft_dir(kind, target_path)
    try:
        read_draft_config(path)
        return path
    except ValueError:
        pass
    train_draft(target_path or default_model_path(), kind, path, progress=progress)
    return path


def add_train_draft_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-draft", help="train an EAGLE/DFlash/DSpark drafter for a "
                              "target by self-distillation on ShareGPT prompts")
    p.add_argument("--target", default=None, help="target model (HF folder or .gguf); "
                   "default SmolLM2-135M-Instruct")
    p.add_argument("--kind", choices=KINDS, required=True)
    p.add_argument("--out", default=None, help="output directory (default: the cache's "
                   "default drafter directory for this target and kind)")
    p.add_argument("--num-prompts", type=int, default=DEFAULTS["num_prompts"])
    p.add_argument("--num-held-out", type=int, default=DEFAULTS["num_held_out"])
    p.add_argument("--max-new-tokens", type=int, default=DEFAULTS["max_new_tokens"])
    p.add_argument("--epochs", type=int, default=DEFAULTS["epochs"])
    p.add_argument("--gamma", type=int, default=DEFAULTS["gamma"])
    p.add_argument("--window", type=int, default=DEFAULTS["window"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.set_defaults(func=cmd_train_draft)
    return p


def cmd_train_draft(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pdserve.engine.loader import default_model_path

    console = Console(stderr=True)
    target = args.target or default_model_path()
    out = args.out or default_draft_dir(args.kind, target)
    try:
        stats = train_draft(target, args.kind, out, num_prompts=args.num_prompts,
                            num_held_out=args.num_held_out, max_new_tokens=args.max_new_tokens,
                            epochs=args.epochs, gamma=args.gamma, window=args.window,
                            lr=args.lr, seed=args.seed)
    except ValueError as e:
        console.print(f"[bold red]train-draft failed[/]: {e}")
        return 1
    acc = stats["held_out_acceptance_length"]
    console.print(f"[bold green]saved[/] {args.kind} drafter to {out}: held-out acceptance "
                  f"length {acc if acc is None else round(acc, 3)} at gamma {args.gamma}, "
                  f"{stats['total_time_s']} s")
    return 0
