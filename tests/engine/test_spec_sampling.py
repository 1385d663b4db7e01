"""Speculative decoding with sampling (invariant 2): the output distribution is the target's.

The engine drafts for sampled requests too. A draft is a point mass, so the lossless rejection
rule reduces to: draw the target's token at each verified position with that output position's
own seeded generator and accept the draft exactly when it equals that token. This file checks it
end to end on a tiny random Llama with an 8-token vocabulary:

- the exact joint distribution of the first T_OUT output tokens is computed by running the target
  on every prefix (the engine's own raw logprobs over the whole vocabulary, cross-checked against
  transformers in fp32), then N seeded requests are sampled through a speculating engine whose
  drafter is right often but not always (acceptances and rejections at every draft position), and
  Pearson's chi-square goodness-of-fit test must not reject at ALPHA;
- the same test, on the same seeds, must reject at ALPHA for deliberately broken verifiers: one
  that accepts every draft, one that replaces a rejected draft by a fresh draw from p instead of
  the residual, and one that emits a rejected draft anyway half the time;
- seeded requests give the same tokens and logprobs with and without speculation, whatever the
  drafter, mixed with greedy requests in one batch with ragged acceptance.

Every seed is fixed, so each verdict is deterministic; the broken verifiers miss by orders of
magnitude (chi-square of about 400 to 30000 on 44 degrees of freedom, whose 0.001 critical value
is about 79; over other seed ranges the correct verifier's p-values spread over 0.06-0.97), not
by luck.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import replace

import pytest
import torch

import pdserve.engine.model_runner as runner_mod
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import LLMEngine, StepOutput
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.sampling import SamplingParams, probs_from_logits
from pdserve.engine.spec import Draft, Drafter, DraftRequest

from tests.conftest import make_tiny_hf_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 8  # vocabulary: every prefix of the joint distribution can be enumerated
PROMPT = [3, 5, 4, 6]
T_OUT = 5  # joint of the first 5 output tokens: the first from prefill, then drafts at 3 positions
K = 3  # num_speculative_tokens
N = 3000  # sampled requests per goodness-of-fit test
ALPHA = 1e-3  # significance level of every chi-square test here
MIN_EXPECTED = 5.0  # cells expected fewer times than this are pooled
SEED0 = 1_000  # request i is seeded SEED0 + i

T1 = SamplingParams(temperature=1.0, max_tokens=T_OUT, ignore_eos=True)
T07 = SamplingParams(temperature=0.7, top_p=0.9, top_k=4, max_tokens=T_OUT, ignore_eos=True)


@pytest.fixture(scope="module")
def small_vocab_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    # A larger init with tied embeddings makes the next-token distributions peaked but not
    # degenerate: a drafter can be right often, and the joint has a few dozen likely cells.
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama_v8"), "llama", vocab_size=V,
                              tie_word_embeddings=True, initializer_range=0.5,
                              max_position_embeddings=128)


@pytest.fixture(scope="module")
def repro_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    # For token-for-token and logprob comparisons: a smaller init keeps the logits small, so
    # fp32 rounding differences between a position run as a decode row and as a draft row of a
    # verify chunk stay far below 1e-5. (With initializer_range=0.5 they reach ~1.3e-5 even
    # without speculation: a decode step against a prefill chunk over the same tokens.)
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama_v8_repro"), "llama",
                              vocab_size=V, tie_word_embeddings=True, initializer_range=0.1,
                              max_position_embeddings=128)


def make_engine(path: str, spec: SpecConfig | None = None, *, max_num_seqs: int = 512
                ) -> LLMEngine:
    return LLMEngine(EngineConfig(
        path, cache=CacheConfig(block_size_tokens=8, num_blocks=4 * max_num_seqs),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                                  max_waiting=100_000),
        spec=spec))


def spec_config() -> SpecConfig:
    # No confidence scheduling: it may cut drafts, and this file wants every draft verified.
    return SpecConfig(method="ngram", num_speculative_tokens=K, schedule=False)


# ---- the exact distribution --------------------------------------------------------------------
class ExactTree:
    """The target's next-token distributions on every output prefix likely enough to matter.

    A prefix is expanded when its probability is at least MIN_EXPECTED / N (below that, it and
    everything under it falls in the pooled cell anyway); `leaves` holds the full-length output
    sequences above that bound with their exact probability, `cond[prefix]` the target's
    distribution after it and `raw[prefix]` its raw log-softmax (for the transformers check)."""

    def __init__(self, engine: LLMEngine, params: SamplingParams, n: int = N) -> None:
        self.cond: dict[tuple[int, ...], torch.Tensor] = {}
        self.raw: dict[tuple[int, ...], torch.Tensor] = {}
        frontier: dict[tuple[int, ...], float] = {(): 1.0}
        for _ in range(T_OUT):
            prefixes = list(frontier)
            for pre, logp in zip(prefixes, raw_logprobs(engine, prefixes)):
                self.raw[pre] = logp
                self.cond[pre] = probs_from_logits(logp, params).double()
            nxt: dict[tuple[int, ...], float] = {}
            for pre in prefixes:
                for x, q in enumerate(self.cond[pre].tolist()):
                    if frontier[pre] * q * n >= MIN_EXPECTED:
                        nxt[pre + (x,)] = frontier[pre] * q
            frontier = nxt
        self.leaves = frontier

    def impossible(self, seq: tuple[int, ...]) -> bool:
        """True when some token of `seq` has probability zero after an expanded prefix."""
        for j in range(len(seq)):
            c = self.cond.get(seq[:j])
            if c is None:
                return False
            if c[seq[j]] == 0:
                return True
        return False


def raw_logprobs(engine: LLMEngine, prefixes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    """The target's raw log-softmax [V] after PROMPT + prefix, for each prefix (one greedy step
    asking for all V logprobs)."""
    p = SamplingParams(max_tokens=1, ignore_eos=True, logprobs=V)
    rids = [engine.add_request(None, PROMPT + list(pre), p) for pre in prefixes]
    got: dict[str, torch.Tensor] = {}
    while engine.has_work():
        for o in engine.step():
            assert o.logprobs is not None and len(o.logprobs[0].top) == V
            lp = torch.empty(V, dtype=torch.float32)
            for tok, val in o.logprobs[0].top:
                lp[tok] = val
            got[o.request_id] = lp
    return [got[r] for r in rids]


@pytest.fixture(scope="module")
def exact(small_vocab_llama) -> dict[str, ExactTree]:
    engine = make_engine(small_vocab_llama)
    return {"t1": ExactTree(engine, T1), "t07": ExactTree(engine, T07)}


def test_exact_distribution_matches_transformers(small_vocab_llama, exact):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(small_vocab_llama, torch_dtype=torch.float32).eval()
    tree = exact["t1"]
    by_len: dict[int, list[tuple[int, ...]]] = {}
    for pre in tree.raw:
        by_len.setdefault(len(pre), []).append(pre)
    with torch.inference_mode():
        for prefixes in by_len.values():
            ids = torch.tensor([PROMPT + list(p) for p in prefixes])
            ref = torch.log_softmax(hf(ids).logits[:, -1].float(), dim=-1)
            ours = torch.stack([tree.raw[p] for p in prefixes])
            assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    # The distributions are peaked but not degenerate, and the tree covers most of the mass.
    first = tree.cond[()]
    assert 0.2 < float(first.max()) < 0.9
    assert sum(tree.leaves.values()) > 0.85
    assert len(tree.leaves) >= 20


# ---- the chi-square test ----------------------------------------------------------------------
def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df) (regularised upper incomplete gamma; no scipy)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def chi_square(tree: ExactTree, outputs: list[tuple[int, ...]]) -> tuple[float, int, float]:
    """Pearson's goodness of fit of `outputs` to the exact joint: (statistic, df, p-value).

    Cells are the tree's leaves; every other sequence, and any leaf expected fewer than
    MIN_EXPECTED times, is pooled into one cell (itself merged into the smallest cell if it is
    still too small). A sequence of probability zero fails outright (p = 0)."""
    n = len(outputs)
    if any(tree.impossible(s) for s in outputs):
        return math.inf, 0, 0.0
    counts = Counter(outputs)
    cells = []  # (expected, observed)
    pool_e, pool_o = float(n), n
    for seq, q in tree.leaves.items():
        e, o = q * n, counts.get(seq, 0)
        if e >= MIN_EXPECTED:
            cells.append((e, o))
            pool_e -= e
            pool_o -= o
    if pool_e >= MIN_EXPECTED:
        cells.append((pool_e, pool_o))
    else:
        cells.sort()
        e, o = cells[0]
        cells[0] = (e + pool_e, o + pool_o)
    stat = sum((o - e) ** 2 / e for e, o in cells)
    df = len(cells) - 1
    return stat, df, chi2_sf(stat, df)


# ---- drafters ----------------------------------------------------------------------------------
class MarkovDrafter(Drafter):
    """Chains a fixed bigram table from the history's last token; at about a quarter of the
    positions (picked by a generator seeded from the history) it proposes a different token.
    Deterministic in the history (a request's drafts never depend on the batch), right often
    but not always."""

    def __init__(self, table: list[int]) -> None:
        self.table = table

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            h = sum((j + 1) * t for j, t in enumerate(r.token_ids))
            last, d = r.token_ids[-1], []
            for i in range(r.k):
                x = self.table[last]
                if random.Random(h * 64 + i).random() < 0.25:
                    x = (x + 1 + i) % V
                d.append(x)
                last = x
            out.append(Draft(d))
        return out


def bigram_table(tree: ExactTree) -> list[int]:
    """Per token a, the target's most likely next token after a, averaged over the tree's
    prefixes ending in a: a cheap 'different model' for the drafter."""
    mass = torch.zeros(V, V, dtype=torch.float64)
    weight = {(): 1.0}
    for pre, c in tree.cond.items():  # prefixes in order of length, parents first
        w = weight.get(pre, 0.0)
        mass[(PROMPT + list(pre))[-1]] += w * c
        for x in range(V):
            weight[pre + (x,)] = w * float(c[x])
    return [int(mass[a].argmax()) if mass[a].sum() > 0 else a for a in range(V)]


class NoisyOracle(Drafter):
    """Proposes the known continuation of a request with one wrong token at a position that
    depends on the history's length (sometimes past the draft: all accepted)."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]]) -> None:
        self.truth = truth

    def propose(self, requests: list[DraftRequest]) -> list[Draft]:
        out = []
        for r in requests:
            h = r.token_ids
            d: list[int] = []
            for prompt, full in self.truth.items():
                if tuple(h[:len(prompt)]) == prompt and full[:len(h)] == h:
                    d = list(full[len(h):len(h) + r.k])
                    bad = (len(h) * 7 + len(prompt)) % (r.k + 2)
                    if bad < len(d):
                        d[bad] = (d[bad] + 1) % V
                    break
            out.append(Draft(d))
        return out


# ---- running ----------------------------------------------------------------------------------
class VerifySpy:
    """Counts, per draft position, how often a draft was verified and accepted, around whatever
    `verify_greedy` the model runner module holds (the real one or a broken stand-in)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.drafted = [0] * K
        self.accepted = [0] * K
        inner = runner_mod.verify_greedy

        def spy(draft: list[int], target: list[int]) -> tuple[int, list[int]]:
            a, emit = inner(draft, target)
            for i in range(len(draft)):
                self.drafted[i] += 1
            for i in range(a):
                self.accepted[i] += 1
            return a, emit

        monkeypatch.setattr(runner_mod, "verify_greedy", spy)


def sample_outputs(engine: LLMEngine, params: SamplingParams, n: int = N
                   ) -> list[tuple[int, ...]]:
    rids = [engine.add_request(None, PROMPT, replace(params, seed=SEED0 + i)) for i in range(n)]
    outs: dict[str, list[int]] = {r: [] for r in rids}
    while engine.has_work():
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
    assert all(len(outs[r]) == T_OUT for r in rids)
    return [tuple(outs[r]) for r in rids]


def spec_engine(path: str, tree: ExactTree) -> LLMEngine:
    engine = make_engine(path, spec_config())
    engine.runner.drafter = MarkovDrafter(bigram_table(tree))
    return engine


# ---- 1. the correct verifier passes ------------------------------------------------------------
@pytest.mark.parametrize("which,params", [("t1", T1), ("t07", T07)])
def test_speculative_sampling_matches_the_exact_joint(small_vocab_llama, exact, monkeypatch,
                                                      which, params):
    tree = exact[which]
    spy = VerifySpy(monkeypatch)
    engine = spec_engine(small_vocab_llama, tree)
    outputs = sample_outputs(engine, params)
    stat, df, p = chi_square(tree, outputs)
    print(f"{which}: chi2={stat:.1f} df={df} p={p:.3g} drafted={spy.drafted} "
          f"accepted={spy.accepted}")
    # Both acceptances and rejections at every draft position, as the engine counts them too.
    s = engine.stats()
    assert s["spec_decode_num_accepted_tokens_per_pos"] == spy.accepted
    assert s["spec_decode_num_draft_tokens"] == sum(spy.drafted)
    assert all(0 < a < d for a, d in zip(spy.accepted, spy.drafted)), (spy.drafted, spy.accepted)
    assert df >= 10
    assert p >= ALPHA, (stat, df, p)


# ---- 2. broken verifiers fail ------------------------------------------------------------------
def accept_everything(draft: list[int], target: list[int]) -> tuple[int, list[int]]:
    """Broken: every draft is emitted, the target only adds the bonus token."""
    return len(draft), list(draft) + [target[len(draft)]]


def install_sloppy_verifier(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken: a rejected draft is emitted anyway half the time (and checking goes on)."""
    rng = random.Random(7)

    def sloppy(draft: list[int], target: list[int]) -> tuple[int, list[int]]:
        a = 0
        while a < len(draft) and (draft[a] == target[a] or rng.random() < 0.5):
            a += 1
        return a, list(draft[:a]) + [target[a]]

    monkeypatch.setattr(runner_mod, "verify_greedy", sloppy)


def install_fresh_redraw(monkeypatch: pytest.MonkeyPatch) -> None:
    """Broken: on a rejection the replacement is a fresh draw from p (its own generator), not
    the residual p without the draft, so the draft token comes out too often. The verifier
    reads p from the logits of the rows the engine just sampled (found by the request's params,
    which are the same object on each of its rows)."""
    last: dict[str, object] = {}
    real_sample, real_verify = runner_mod.sample, ModelRunner._verify
    gen = torch.Generator().manual_seed(99)

    def spy_sample(logits, params, index):
        last.update(logits=logits, params=params)
        return real_sample(logits, params, index)

    def redraw(self, seq, target):
        rows = [i for i, p in enumerate(last["params"]) if p is seq.params]
        assert len(rows) == len(target) == len(seq.spec_token_ids) + 1
        target = list(target)
        for j, d in enumerate(seq.spec_token_ids):
            if target[j] != d:
                probs = probs_from_logits(last["logits"][rows[j]], seq.params)
                target[j] = int(torch.multinomial(probs, 1, generator=gen))
                break
        return real_verify(self, seq, target)

    monkeypatch.setattr(runner_mod, "sample", spy_sample)
    monkeypatch.setattr(ModelRunner, "_verify", redraw)


@pytest.mark.parametrize("broken", ["accept_everything", "fresh_redraw", "sloppy"])
def test_broken_verifiers_are_rejected(small_vocab_llama, exact, monkeypatch, broken):
    tree = exact["t1"]
    if broken == "accept_everything":
        monkeypatch.setattr(runner_mod, "verify_greedy", accept_everything)
    elif broken == "fresh_redraw":
        install_fresh_redraw(monkeypatch)
    else:
        install_sloppy_verifier(monkeypatch)
    spy = VerifySpy(monkeypatch)
    engine = spec_engine(small_vocab_llama, tree)
    outputs = sample_outputs(engine, T1)
    stat, df, p = chi_square(tree, outputs)
    print(f"{broken}: chi2={stat:.1f} df={df} p={p:.3g} drafted={spy.drafted} "
          f"accepted={spy.accepted}")
    assert sum(spy.drafted) > 0
    assert p < ALPHA, (stat, df, p)


# ---- 3. seeded reproducibility -----------------------------------------------------------------
def mixed_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(V) for _ in range(3 + i % 4)] for i in range(12)]
    kinds = [
        SamplingParams(max_tokens=20, ignore_eos=True),  # greedy
        SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=4, max_tokens=18, ignore_eos=True,
                       logprobs=3),
        SamplingParams(temperature=1.3, max_tokens=16, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=20, ignore_eos=True, logprobs=2),  # greedy with logprobs
        SamplingParams(temperature=0.5, top_k=2, max_tokens=20, ignore_eos=True),
    ]
    params = [replace(kinds[i % len(kinds)], seed=None if kinds[i % len(kinds)].temperature == 0
                      else 50 + i) for i in range(len(prompts))]
    return prompts, params


def run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]):
    """Per prompt: output tokens, logprobs (or None); and each step's StepOutputs."""
    rids = [engine.add_request(None, p, q) for p, q in zip(prompts, params)]
    toks: dict[str, list[int]] = {r: [] for r in rids}
    lps: dict[str, list] = {r: [] for r in rids}
    steps: list[list[StepOutput]] = []
    while engine.has_work():
        step = engine.step()
        steps.append(step)
        for o in step:
            toks[o.request_id].extend(o.new_token_ids)
            if o.logprobs is not None:
                assert len(o.logprobs) == len(o.new_token_ids)
                lps[o.request_id].extend(o.logprobs)
    return [toks[r] for r in rids], [lps[r] for r in rids], steps, rids


@pytest.mark.parametrize("drafter", ["ngram", "markov", "noisy_oracle"])
def test_seeded_sampling_with_speculation_reproduces_plain_output(repro_llama, drafter):
    prompts, params = mixed_batch()
    plain = make_engine(repro_llama)
    want, want_lps, _, _ = run(plain, prompts, params)
    spec = make_engine(repro_llama, spec_config())
    if drafter == "markov":
        spec.runner.drafter = MarkovDrafter(bigram_table(ExactTree(plain, T1)))
    elif drafter == "noisy_oracle":
        spec.runner.drafter = NoisyOracle({tuple(p): p + o for p, o in zip(prompts, want)})
    got, got_lps, steps, rids = run(spec, prompts, params)
    assert got == want
    for p, a, b in zip(params, want_lps, got_lps):
        if p.logprobs is None:
            assert a == b == []
            continue
        assert len(a) == len(b) == p.max_tokens
        for x, y in zip(a, b):
            assert x.token_id == y.token_id
            assert abs(x.logprob - y.logprob) < 1e-5, (x, y)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert all(abs(u - v) < 1e-5 for (_, u), (_, v) in zip(x.top, y.top)), (x, y)
    s = spec.stats()
    assert 0 < s["spec_decode_num_accepted_tokens"] < s["spec_decode_num_draft_tokens"]
    # Sampled requests had drafts accepted (a step emitting several tokens), and acceptance
    # was ragged within one step.
    sampled = {r for r, p in zip(rids, params) if p.temperature > 0}
    assert any(o.request_id in sampled and len(o.new_token_ids) > 1
               for step in steps for o in step)
    assert any(len({len(o.new_token_ids) for o in step}) > 1 for step in steps)
    assert s["num_free_blocks"] == s["num_total_blocks"]
