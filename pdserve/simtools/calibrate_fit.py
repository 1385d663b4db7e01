"""The fits of `pdserve sim calibrate` (pure): step constants, transfer links and serving costs
from measured points, and the profile built from them.

Owns least squares on relative error for the step constants (coefficients kept non-negative),
the latency + bandwidth line of a transport, and what a cluster's served decode gaps and first
tokens exceed the fitted engine steps by. Must not measure (`calibrate.py` does) or simulate.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.core.step_profile import StepProfile, TransportLink, attn_pairs

FEATURES = ("overhead_s", "prefill_fixed_s", "decode_fixed_s", "prefill_token_s",
            "prefill_attn_s", "decode_seq_s", "decode_ctx_s")
SERVING = ("serve_step_s", "serve_seq_s", "serve_prefill_step_s", "serve_prefill_token_s")


@dataclass(frozen=True)
class Point:
    kind: str  # "prefill", "batched" (prefill of several prompts), "decode", "mixed"
    prefill_tokens: int  # in all: `prompts` prompts of prefill_tokens / prompts each
    cached_tokens: int
    decode_batch: int
    decode_ctx: int
    seconds: float
    prompts: int = 1

    def row(self) -> list[float]:
        p, b, k = self.prefill_tokens, self.decode_batch, self.prompts
        return [1.0, float(p > 0), float(b > 0), p,
                k * attn_pairs(p // k, self.cached_tokens) if p else 0.0, b, self.decode_ctx]



# ---- the fit (pure) ---------------------------------------------------------------------------
def fit_steps(points: list[Point]) -> tuple[dict[str, float], dict[str, Any]]:
    """Coefficients (named as StepProfile fields) minimising relative error, all >= 0: a column
    that comes out negative is dropped and the rest refitted. Also the error per kind."""
    if len(points) < len(FEATURES):
        raise ValueError(f"need at least {len(FEATURES)} points to fit, got {len(points)}")
    x = np.array([p.row() for p in points], dtype=float)
    y = np.array([p.seconds for p in points], dtype=float)
    w = 1.0 / y
    active = [i for i in range(len(FEATURES)) if np.any(x[:, i] != 0)]
    coef = np.zeros(len(FEATURES))
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active = [i for i, c in zip(active, sol) if c >= 0 and c != sol.min()]
    pred = x @ coef
    rel = (pred - y) / y
    errors = {}
    for kind in ("prefill", "batched", "decode", "mixed"):
        sel = np.array([p.kind == kind for p in points])
        if sel.any():
            errors[kind] = {"points": int(sel.sum()),
                            "mean_abs_rel_error": float(np.mean(np.abs(rel[sel]))),
                            "max_abs_rel_error": float(np.max(np.abs(rel[sel])))}
    return dict(zip(FEATURES, map(float, coef))), errors


def fit_transfer(rows: list[tuple[int, float]]) -> TransportLink:
    """latency + bytes / bandwidth through (size, seconds) rows (least squares, latency >= 0)."""
    sizes = np.array([r[0] for r in rows], dtype=float)
    secs = np.array([r[1] for r in rows], dtype=float)
    if len(set(sizes)) < 2:
        raise ValueError("a transfer fit needs at least two sizes")
    slope, icpt = np.polyfit(sizes, secs, 1)
    if slope <= 0:  # noise beat the size difference: bandwidth from the largest size alone
        i = int(np.argmax(sizes))
        return TransportLink(0.0, float(sizes[i] / secs[i]))
    if icpt < 0:
        slope, icpt = float(np.sum(sizes * secs) / np.sum(sizes * sizes)), 0.0
    return TransportLink(float(icpt), float(1.0 / slope))


def _nonneg_line(x: np.ndarray, resid: np.ndarray) -> tuple[float, float]:
    """(intercept, slope), both >= 0, least squares through (x, resid): through the origin when
    the intercept would be negative, the mean when the slope would be."""
    if len(set(x)) >= 2:
        slope, icpt = np.polyfit(x, resid, 1)
        if slope >= 0 and icpt >= 0:
            return float(icpt), float(slope)
        if slope >= 0:  # through the origin: all of it per unit
            return 0.0, max(0.0, float(np.sum(x * resid) / np.sum(x * x)))
    return max(0.0, float(np.mean(resid))), 0.0


def fit_serving(base: StepProfile, rows: list[dict[str, float]]) -> tuple[float, float]:
    """(serve_step_s, serve_seq_s): what a served decode step takes beyond `base`'s engine step,
    fitted (least squares, both >= 0) to the residuals of `rows` ({batch, ctx, gap_s}: the median
    gap between a cluster's streamed tokens at that decode batch and context). (0, 0) without
    rows."""
    if not rows:
        return 0.0, 0.0
    b = np.array([r["batch"] for r in rows], dtype=float)
    resid = np.array([r["gap_s"] - base.decode_s(int(r["batch"]), int(r["ctx"])) for r in rows])
    return _nonneg_line(b, resid)


def fit_serving_prefill(base: StepProfile, rows: list[dict[str, float]]) -> tuple[float, float]:
    """(serve_prefill_step_s, serve_prefill_token_s): what a served prompt's first token takes
    beyond `base`'s engine prefill step (its KV streamed out layer by layer, the token's way to
    the client), fitted (least squares, both >= 0) to `rows` ({tokens, ttft_s}: single prompts
    on an idle cluster). (0, 0) without rows."""
    if not rows:
        return 0.0, 0.0
    engine = dataclasses.replace(base, serve_prefill_step_s=0.0, serve_prefill_token_s=0.0)
    n = np.array([r["tokens"] for r in rows], dtype=float)
    resid = np.array([r["ttft_s"] - engine.prefill_s(int(r["tokens"])) for r in rows])
    return _nonneg_line(n, resid)


def with_serving(prof: StepProfile, times: dict[str, Any]) -> StepProfile:
    """`prof` with its serving costs fitted to a cluster's `serving` and `serving_prefill`
    rows (`calibrate_cluster`), kept under `fit`."""
    step, seq = fit_serving(prof, times.get("serving", []))
    p_step, p_tok = fit_serving_prefill(prof, times.get("serving_prefill", []))
    return dataclasses.replace(prof, serve_step_s=step, serve_seq_s=seq,
                               serve_prefill_step_s=p_step, serve_prefill_token_s=p_tok)


def build_profile(points: list[Point], transfers: dict[str, list[tuple[int, float]]],
                  meta: dict[str, Any]) -> StepProfile:
    coef, errors = fit_steps(points)
    links = {name: fit_transfer(rows) for name, rows in transfers.items()}
    prof = StepProfile(
        origin=meta["origin"], model=meta["model"], **coef, transports=links,
        kv_bytes_per_token=meta["kv_bytes_per_token"], flip_s=meta.get("flip_s", 0.0),
        startup_s=meta.get("startup_s", 0.0), kv_capacity_tokens=meta["kv_capacity_tokens"],
        host_cores=meta.get("host_cores"), threads_per_worker=meta.get("threads", 1),
        host_slowdown=tuple(meta.get("host_slowdown", ())),
        host_slowdown_decode=tuple(meta.get("host_slowdown_decode", ())),
        fit={"method": "least squares on relative error", "errors": errors,
             "points": [p.__dict__ for p in points],
             "transfers": {k: [list(r) for r in v] for k, v in transfers.items()},
             **{k: v for k, v in meta.items() if k not in ("origin", "model")}})
    return with_serving(prof, meta)
