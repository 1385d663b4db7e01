"""Confidence-scheduled verification: how many of each request's drafts a step verifies.

Verifying drafts is not free: every draft token widens the target's forward. After the DSpark
paper, each step cuts each request's draft to the prefix that maximises the expected number of
emitted tokens per second of step time, using a table of what a target forward of T tokens
costs on this machine (`StepCostTable`, measured by `profile_step_costs`). On an idle machine
(flat cost in T) whole drafts are verified; on a busy one (cost growing with T) the
low-confidence tails are cut, and with an expensive drafter nothing is drafted at all.

`plan_draft_lengths` is a pure core (numbers in, lengths out, no clock); `AcceptanceEstimator`
turns the engine's acceptance counters into per-position probabilities for drafters without a
confidence head. `profile_step_costs` is the thin adapter that runs the model; it uses a scratch
KV cache and must not touch the engine's own cache, block pool or scheduler.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.model import LlamaModel

DEFAULT_PROFILE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


# ---- the step-cost table ----------------------------------------------------------------------
class StepCostTable:
    """Seconds of one target forward of T flat-batch tokens (decode + draft + prefill tokens).

    Built from measured (T, seconds) points. Timings are noisy, so the table is made monotone
    non-decreasing on construction (a running max over T): a larger batch never looks cheaper,
    which the planner relies on. Between points it interpolates linearly; past the last point it
    extrapolates along the last segment; below the first point it is flat (a forward reads every
    weight however few tokens it runs).
    """

    def __init__(self, points: Mapping[int, float] | Iterable[tuple[int, float]]) -> None:
        items = sorted((points.items() if isinstance(points, Mapping) else points))
        if not items:
            raise ValueError("a step-cost table needs at least one (tokens, seconds) point")
        tokens: list[int] = []
        seconds: list[float] = []
        for t, s in items:
            t, s = int(t), float(s)
            if t <= 0 or not math.isfinite(s) or s < 0:
                raise ValueError(f"bad step-cost point ({t}, {s}): tokens must be positive and "
                                 "seconds finite and non-negative")
            s = max(s, seconds[-1]) if seconds else s
            if tokens and tokens[-1] == t:  # repeated size: keep the larger (still monotone)
                seconds[-1] = s
                continue
            tokens.append(t)
            seconds.append(s)
        self.tokens: tuple[int, ...] = tuple(tokens)
        self.seconds: tuple[float, ...] = tuple(seconds)

    def __call__(self, num_tokens: int | float) -> float:
        return self.cost(num_tokens)

    def cost(self, num_tokens: int | float) -> float:
        ts, ss = self.tokens, self.seconds
        if num_tokens <= ts[0] or len(ts) == 1:
            return ss[0]
        i = bisect.bisect_left(ts, num_tokens)
        if i < len(ts) and ts[i] == num_tokens:
            return ss[i]
        if i == len(ts):  # past the last point: the last segment's slope
            i = len(ts) - 1
        t0, t1, s0, s1 = ts[i - 1], ts[i], ss[i - 1], ss[i]
        return s0 + (s1 - s0) * (num_tokens - t0) / (t1 - t0)

    def to_dict(self) -> dict[str, Any]:
        return {"tokens": list(self.tokens), "seconds": list(self.seconds)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StepCostTable":
        if len(d["tokens"]) != len(d["seconds"]):
            raise ValueError("step-cost table: tokens and seconds differ in length")
        return cls(zip(d["tokens"], d["seconds"]))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, StepCostTable) and self.tokens == other.tokens
                and self.seconds == other.seconds)

    def __repr__(self) -> str:
        pts = ", ".join(f"{t}: {s:.4g}" for t, s in zip(self.tokens, self.seconds))
        return f"StepCostTable({{{pts}}})"


# ---- the planner (pure) -----------------------------------------------------------------------
def expected_tokens(probs: Sequence[float], length: int) -> float:
    """Expected tokens one request emits when `length` drafts are verified: the target's own
    token, plus draft j when drafts 0..j are all accepted (probs are conditional)."""
    e, c = 1.0, 1.0
    for p in probs[:length]:
        c *= p
        e += c
    return e


def plan_draft_lengths(accept_probs: Sequence[Sequence[float]], base_tokens: int,
                       cost: StepCostTable | Callable[[int], float],
                       draft_cost_s: float = 0.0) -> list[int]:
    """Per decoding request, how many of its drafts to verify this step.

    accept_probs[r][i]: P(draft i of request r accepted | drafts < i accepted). base_tokens: the
    tokens the step runs anyway (each decoding request's own token plus any prefill chunk).
    Maximises (sum_r expected_tokens(r, L_r)) / (cost(base_tokens + sum_r L_r) + draft_cost_s
    if any L_r > 0 else 0). The cumulative acceptance products are non-increasing along each
    draft, so for a given total m the best choice is the m largest products overall (always
    prefixes); every m is tried and the best ratio wins, ties going to fewer tokens.
    O(M log M) in the number of draft tokens M; deterministic.
    """
    if base_tokens < 0 or draft_cost_s < 0 or not math.isfinite(draft_cost_s):
        raise ValueError(f"base_tokens ({base_tokens}) and draft_cost_s ({draft_cost_s}) must "
                         "be non-negative")
    cands: list[tuple[float, int, int]] = []  # (-cumulative product, request, position)
    for r, probs in enumerate(accept_probs):
        c = 1.0
        for j, p in enumerate(probs):
            if not 0.0 <= p <= 1.0:  # also rejects NaN
                raise ValueError(f"accept_probs[{r}][{j}] = {p} is not a probability")
            c *= p
            cands.append((-c, r, j))
    # Ties within a request keep position order (j ascending), so every prefix of this order
    # takes a prefix of each request's draft.
    cands.sort()
    lengths = [0] * len(accept_probs)
    if not cands:
        return lengths

    def rate(value: float, step_s: float) -> float:
        return value / step_s if step_s > 0 else math.inf

    value = float(len(accept_probs))
    best_m, best = 0, rate(value, cost(base_tokens))
    for m, (neg_c, _, _) in enumerate(cands, start=1):
        value -= neg_c
        x = rate(value, cost(base_tokens + m) + draft_cost_s)
        if x > best * (1 + 1e-12):  # strictly better: float noise never buys tokens
            best_m, best = m, x
    for _, r, _ in cands[:best_m]:
        lengths[r] += 1
    return lengths


# ---- acceptance rates from counters -----------------------------------------------------------
class AcceptanceEstimator:
    """Per-position conditional acceptance rates, for drafters without a confidence head.

    Position i is *tried* in a verification that reached it (drafts 0..i-1 accepted, and at
    least i+1 drafts proposed); it is *accepted* if draft i was too. The estimate is the
    posterior mean under a Beta prior (mean `prior_mean`, weight `prior_weight` pseudo-trials),
    so a position never seen is neither certain nor hopeless.
    """

    def __init__(self, prior_mean: float = 0.5, prior_weight: float = 2.0) -> None:
        if not 0.0 < prior_mean < 1.0 or prior_weight <= 0:
            raise ValueError("prior_mean must be in (0, 1) and prior_weight positive")
        self.prior_mean = prior_mean
        self.prior_weight = prior_weight
        self.tried: list[float] = []  # counts, fractional once `forget` scales them
        self.accepted: list[float] = []

    def update(self, num_draft: int, num_accepted: int) -> None:
        """One verification: `num_draft` drafts proposed, the first `num_accepted` accepted."""
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"need 0 <= num_accepted ({num_accepted}) <= num_draft ({num_draft})")
        reached = min(num_accepted + 1, num_draft)  # positions tried
        while len(self.tried) < reached:
            self.tried.append(0)
            self.accepted.append(0)
        for i in range(reached):
            self.tried[i] += 1
        for i in range(num_accepted):
            self.accepted[i] += 1

    def forget(self, factor: float) -> None:
        """Scale all evidence by `factor` in (0, 1]. Called once per step, old evidence fades
        and the estimate drifts back to the prior, so positions the planner stopped drafting
        (and so stopped measuring) are tried again after a while instead of never."""
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"factor must be in (0, 1], got {factor}")
        self.tried = [t * factor for t in self.tried]
        self.accepted = [a * factor for a in self.accepted]

    def probs(self, k: int) -> list[float]:
        a, w = self.prior_mean * self.prior_weight, self.prior_weight
        return [((self.accepted[i] if i < len(self.accepted) else 0) + a)
                / ((self.tried[i] if i < len(self.tried) else 0) + w) for i in range(k)]


# ---- profiling (the adapter: runs the model, reads the clock) ---------------------------------
def _decode_shaped_batch(num_tokens: int, tokens_per_seq: int, context_tokens: int,
                         block_size: int, vocab_size: int, device: Any):
    """A flat batch of `num_tokens` tokens in sequences of `tokens_per_seq` (the last may be
    shorter), each after a shared context of `context_tokens`. Sequences share their context
    blocks and pack their new tokens into shared tail blocks at distinct offsets, so the scratch
    cache grows with T, not with T x context. Returns (StepInput, slots needed)."""
    import torch

    from pdserve.engine.attention import build_attention_metadata
    from pdserve.engine.model import StepInput

    ctx_blocks = -(-context_tokens // block_size)
    ctx = ctx_blocks * block_size
    q = tokens_per_seq
    per_group = max(1, block_size // q)  # sequences sharing one run of tail blocks
    tail_blocks = -(-per_group * q // block_size)
    meta_in: list[tuple[int, int, list[int]]] = []
    pos: list[int] = []
    left, i = num_tokens, 0
    gen = torch.Generator().manual_seed(num_tokens)
    while left > 0:
        n = min(q, left)
        g, o = divmod(i, per_group)
        first = ctx_blocks + g * tail_blocks
        table = list(range(ctx_blocks)) + list(range(first, first + tail_blocks))
        start = ctx + o * q
        meta_in.append((start, n, table))
        pos.extend(range(start, start + n))
        left -= n
        i += 1
    groups = -(-i // per_group)
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=gen)
    step = StepInput(ids.to(device), torch.tensor(pos, dtype=torch.long, device=device),
                     build_attention_metadata(meta_in, block_size, device))
    return step, ctx_blocks + groups * tail_blocks


def profile_step_costs(model: "LlamaModel", sizes: Sequence[int] = DEFAULT_PROFILE_SIZES,
                       reps: int = 3, *, block_size: int = 16, context_tokens: int = 64,
                       tokens_per_seq: int = 1, max_tokens: int | None = None,
                       budget_s: float | None = 5.0,
                       clock: Callable[[], float] = time.perf_counter) -> StepCostTable:
    """Time target forwards of each size in `sizes` (capped at `max_tokens`), smallest first,
    and return the table of the fastest of `reps` runs (one untimed warm-up forward first).

    The batch is decode-shaped: sequences of `tokens_per_seq` new tokens (1: plain decode;
    1 + gamma: a verification) after a short shared context, on a scratch paged KV cache of
    `block_size`, so the engine's cache is never touched. With `budget_s`, a size whose
    predicted time (from the points so far) would overrun the budget is skipped, with the sizes
    after it, once two points are in: the table extrapolates along its last segment instead.
    """
    import torch

    from pdserve.engine.attention import PagedKVCache

    if reps <= 0 or tokens_per_seq <= 0 or context_tokens <= 0 or block_size <= 0:
        raise ValueError("reps, tokens_per_seq, context_tokens and block_size must be positive")
    cfg = model.cfg
    context_tokens = min(context_tokens, cfg.max_position_embeddings - tokens_per_seq - block_size)
    if context_tokens <= 0:
        raise ValueError(f"the model's context ({cfg.max_position_embeddings}) is too short to profile")
    todo = sorted({int(t) for t in sizes if t > 0 and (max_tokens is None or t <= max_tokens)})
    if not todo:
        raise ValueError(f"no profile size in {list(sizes)} fits max_tokens={max_tokens}")
    steps = {t: _decode_shaped_batch(t, tokens_per_seq, context_tokens, block_size,
                                     cfg.vocab_size, model.device) for t in todo}
    num_blocks = max(n for _, n in steps.values())
    kv = PagedKVCache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                      cfg.head_dim, model.dtype, model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    model.forward(steps[todo[0]][0], kv)  # warm-up: allocator, kernels, caches
    sync()
    points: dict[int, float] = {}
    started = clock()
    for t in todo:
        if budget_s is not None and len(points) >= 2:
            guess = StepCostTable(points).cost(t) * reps
            if clock() - started + guess > budget_s:
                break
        step, _ = steps[t]
        times = []
        for _ in range(reps):
            t0 = clock()
            model.forward(step, kv)
            sync()
            times.append(clock() - t0)
        # The fastest run: other processes on the same cores only ever add time, and one
        # disturbed profile would mislead every later plan of this engine.
        points[t] = min(times)
    return StepCostTable(points)


def profile_engine_step_costs(engine: "LLMEngine", sizes: Sequence[int] = DEFAULT_PROFILE_SIZES,
                              reps: int = 3, **kwargs: Any) -> StepCostTable:
    """`profile_step_costs` on an engine's model, with its block size and capped at its
    per-step token budget."""
    kwargs.setdefault("block_size", engine.block_size)
    kwargs.setdefault("max_tokens", engine.cfg.scheduler.max_num_batched_tokens)
    return profile_step_costs(engine.model, sizes, reps, **kwargs)
