"""The sampler draws from exactly the distribution `probs_from_logits` describes (checked
statistically), and a deliberately broken sampler is caught by the same check.

Each check draws N tokens from fixed logits over a small vocabulary through `sample`, varying the
output index (one seed) or the seed (one index), and runs two tests at ALPHA:
- Pearson's chi-square goodness of fit, p-value from the regularised upper incomplete gamma
  function (`torch.special.gammaincc`, no scipy);
- a distribution-free bound on the total variation distance (Bretagnolle-Huber-Carol):
  P(TV(empirical, true) >= eps) <= 2^k exp(-2 N eps^2) over k categories.
A draw landing on a token the distribution gives zero mass fails outright. Every seed is fixed,
so each verdict is deterministic; the broken samplers miss by orders of magnitude, not by luck.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

import pdserve.engine.sampling as sampling
from pdserve.engine.sampling import SamplingParams, probs_from_logits, sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

N = 4000
ALPHA = 1e-3
LOGITS = torch.tensor([1.2, 0.9, 0.5, 0.3, 0.0, -0.4, -0.8, -1.3])
V = LOGITS.numel()

CONFIGS = {
    "temperature_0.7": SamplingParams(temperature=0.7, seed=11),
    "top_k_3": SamplingParams(temperature=1.0, top_k=3, seed=12),
    "top_p_0.8": SamplingParams(temperature=1.0, top_p=0.8, seed=13),
    "all_three": SamplingParams(temperature=0.7, top_k=5, top_p=0.8, seed=14),
}


def chi2_sf(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df)."""
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def counts_of(tokens: list[int]) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=V).double()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0  # a token that cannot be drawn was drawn
    expected = n * probs[support].double()
    assert expected.min() >= 5, "chi-square needs >= 5 expected draws per category"
    df = int(support.sum()) - 1
    if df == 0:
        return 1.0
    stat = float(((counts[support] - expected) ** 2 / expected).sum())
    return chi2_sf(stat, df)


def tv_bound(n: int, k: int, alpha: float) -> float:
    """eps with P(TV >= eps) <= alpha for n draws over k categories."""
    return math.sqrt((k * math.log(2) + math.log(1 / alpha)) / (2 * n))


def fits(tokens: list[int], probs: torch.Tensor) -> tuple[bool, float, float]:
    """(passes both tests, chi-square p-value, total variation distance)."""
    counts = counts_of(tokens)
    p = chi2_pvalue(counts, probs)
    tv = 0.5 * float((counts / counts.sum() - probs.double()).abs().sum())
    k = int((probs > 0).sum())
    return p >= ALPHA and tv < tv_bound(len(tokens), k, ALPHA), p, tv


def draw_over_indices(params: SamplingParams, n: int = N) -> list[int]:
    """One request's stream: output indices 0..n-1 under one seed."""
    return sample(LOGITS.expand(n, V), [params] * n, list(range(n)))


def draw_over_seeds(params: SamplingParams, n: int = N) -> list[int]:
    """n requests' first tokens: seeds base..base+n-1 at output index 0."""
    base = params.seed or 0
    return sample(LOGITS.expand(n, V), [replace(params, seed=base + i) for i in range(n)], [0] * n)


# ---- the test itself is calibrated -----------------------------------------------------------------

def test_chi2_pvalue_matches_known_values():
    for x in (0.5, 3.0, 13.8):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-9)  # df 2 is exponential
    assert chi2_sf(24.322, 7) == pytest.approx(1e-3, rel=1e-3)  # table critical value
    assert chi2_sf(0.0, 5) == 1.0
    # Wilson-Hilferty for a larger df agrees to a few percent.
    df, x = 30, 50.0
    z = ((x / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    assert chi2_sf(x, df) == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=0.05)


def test_exact_multinomial_draws_pass():
    # Draws straight from the true distribution pass: the test is not biased against them.
    gen = torch.Generator().manual_seed(0)
    for params in CONFIGS.values():
        probs = probs_from_logits(LOGITS, params)
        tokens = torch.multinomial(probs, N, replacement=True, generator=gen).tolist()
        ok, p, tv = fits(tokens, probs)
        assert ok, (params, p, tv)


# ---- the real sampler is lossless ------------------------------------------------------------------

def test_probs_from_logits_filters_as_documented():
    t07 = probs_from_logits(LOGITS, CONFIGS["temperature_0.7"])
    torch.testing.assert_close(t07, torch.softmax(LOGITS / 0.7, -1))
    k3 = probs_from_logits(LOGITS, CONFIGS["top_k_3"])
    assert (k3[3:] == 0).all()
    torch.testing.assert_close(k3[:3], torch.softmax(LOGITS[:3], -1))
    full = torch.softmax(LOGITS, -1)
    p08 = probs_from_logits(LOGITS, CONFIGS["top_p_0.8"])
    keep = int((p08 > 0).sum())
    # The smallest prefix whose mass reaches 0.8, renormalised.
    assert full[:keep - 1].sum() < 0.8 <= full[:keep].sum()
    torch.testing.assert_close(p08[:keep], full[:keep] / full[:keep].sum())


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("draw", [draw_over_indices, draw_over_seeds], ids=["indices", "seeds"])
def test_sampler_matches_the_exact_distribution(name, draw):
    params = CONFIGS[name]
    tokens = draw(params)
    ok, p, tv = fits(tokens, probs_from_logits(LOGITS, params))
    assert ok, f"{name}: chi-square p={p:.2e}, TV={tv:.4f}"
    assert draw(params) == tokens  # seeded: the same draws every time


def test_each_row_samples_independently_of_its_batch():
    params = CONFIGS["all_three"]
    other = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    batch = torch.cat([other, LOGITS.unsqueeze(0)])
    together = sample(batch, [CONFIGS["top_k_3"], SamplingParams(), params, params], [5, 0, 9, 4])
    assert together[1] == int(other[1].argmax())  # greedy rows are argmax
    assert together[3] == sample(LOGITS.unsqueeze(0), [params], [4])[0]
    assert together[2] == sample(other[2:3], [params], [9])[0]


# ---- broken samplers fail the same test ------------------------------------------------------------

def _ignores_temperature(logits, p):
    return _REAL_PROBS(logits, replace(p, temperature=1.0))


def _top_k_mass_to_argmax(logits, p):
    # Cuts to top-k but piles the removed mass onto the best token instead of renormalising.
    full = torch.softmax(logits.float() / p.temperature, -1)
    kept = _REAL_PROBS(logits, replace(p, top_p=1.0)) > 0
    out = torch.where(kept, full, torch.zeros_like(full))
    out[full.argmax()] += full[~kept].sum()
    return out


def _top_p_drops_the_crossing_token(logits, p):
    # Keeps only tokens whose cumulative mass stays below top_p: one token too few.
    sorted_p, order = torch.sort(torch.softmax(logits.float() / p.temperature, -1), descending=True)
    sorted_p = sorted_p.masked_fill(torch.cumsum(sorted_p, -1) >= p.top_p, 0.0)
    return torch.zeros_like(sorted_p).scatter(0, order, sorted_p)


def _top_p_before_temperature(logits, p):
    # Applies the nucleus to the untempered distribution, then the temperature.
    mask = _REAL_PROBS(logits, replace(p, temperature=1.0, top_k=0)) > 0
    x = logits.float() / p.temperature
    x = x.masked_fill(~mask, float("-inf"))
    if p.top_k:
        x = x.masked_fill(x < torch.topk(x, p.top_k).values[-1], float("-inf"))
    return torch.softmax(x, -1)


_REAL_PROBS = probs_from_logits


@pytest.mark.parametrize("broken, name", [
    (_ignores_temperature, "temperature_0.7"),
    (_ignores_temperature, "all_three"),
    (_top_k_mass_to_argmax, "top_k_3"),
    (_top_p_drops_the_crossing_token, "top_p_0.8"),
    (_top_p_before_temperature, "all_three"),
], ids=["no-temperature", "no-temperature-combined", "top-k-mass-to-argmax",
        "top-p-off-by-one", "top-p-before-temperature"])
def test_a_broken_sampler_fails(monkeypatch, broken, name):
    params = CONFIGS[name]
    assert not torch.allclose(broken(LOGITS, params), _REAL_PROBS(LOGITS, params), atol=0.02)
    monkeypatch.setattr(sampling, "probs_from_logits", broken)
    tokens = draw_over_indices(params)  # the real `sample`, drawing from the broken distribution
    ok, p, tv = fits(tokens, _REAL_PROBS(LOGITS, params))
    assert not ok, f"{name}: a broken sampler passed (p={p:.2e}, TV={tv:.4f})"
    assert p < ALPHA / 1000  # not a near miss
