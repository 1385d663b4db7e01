"""Prefill deflection, as a pure core: whether one arriving request, which a decode worker's
offload budget fits, is prefilled there (in bounded chunks, one chunk a decode step) or on the
prefill pool, whichever gives the lower estimated time to first token.

Owns `deflect` (the choice, with both estimates and why) and `pool_side` (what the choice
needs of the prefill pool's pick, read from the membership table, the rate meter and the
prefill policy's cost of a request). The
live router (`pool.WorkerSet.take_offload`) and the simulator's (`sim/router.py`) call both,
from `route.plan`, so they decide alike.

The estimates:
- on the prefill pool, the worker the prefill policy picked: its queue, in the prefill
  policy's token units (the predicted prefill work in flight plus `request_cost_tokens` for
  each request, this one included: `policy.KvAware`'s measured fixed cost of a request), over
  its measured rate (smoothed: what it has been delivering; a worker not measured yet counts at
  the mean of the pool's measured ones), plus `handoff_s`, a prefill call's fixed cost beyond
  its compute. Both the fixed cost and the smoothed rate because, on a loaded CPU cluster
  (tests/e2e/test_controller.py's offload load: prompts cached, so each computes a few tokens),
  work tokens over the peak rate put the estimate at a tenth of the first tokens measured;
- on a decode worker whose budget fits: the offloaded prompt tokens in flight there plus this
  prompt, in `chunk_tokens` chunks, one chunk per decode step of `step_s` (offloaded requests
  advance in turn, one chunk a step, so this prompt's last chunk comes after theirs).
A decode worker is chosen only when its estimate is lower than the pool's (a tie stays on the
pool: offloaded work costs the running decodes some of their step) and the prompt fits its
budget. Without a measured prefill rate nothing is deflected, unless no prefill worker is
active: then a fitting budget takes the request (the alternative is a decode worker
prefilling it unbounded). A budget without a step time (0: one set by hand) cannot be
estimated: the budget alone decides, as it did before this rule, and the request is deflected.

Must not do I/O, read a clock or change what it reads. A call costs a pass over the budgets
(a small key each) and its result: microseconds, on the request path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.core.rates import RateMeter
from pdserve.core.roles import DECODE, PREFILL
from pdserve.router.policy import KvAware

# A prefill call's fixed cost beyond its compute: the call there and back and the store lookup
# for cached blocks. A round figure for a LAN hop; small beside the queues this rule weighs.
HANDOFF_S = 0.005
DEFAULT_REQUEST_COST = KvAware().request_cost_tokens


class DeflectSlot(Protocol):
    """What `deflect` reads of a decode worker (`membership.Member` has it)."""

    address: str
    offload_tokens: int  # prompt tokens of offloaded requests in flight to it
    offload_budget: int  # the most it may hold (the controller's budget)
    offload_chunk: int  # prompt tokens a decode step prefills for an offloaded request
    offload_step_s: float  # the controller's predicted step carrying one chunk (0: none)


@dataclass(unsafe_hash=True)  # hashed by value
class Deflection:
    """One request's choice: `choice` DECODE (the decode worker at `index` of the candidates
    prefills it) or PREFILL (the pool does); each side's estimated time to first token (None:
    it could not be estimated) and a short reason. Spelled-out `__init__`: see `policy.py`."""

    choice: str
    index: int | None
    prefill_ttft_s: float | None
    decode_ttft_s: float | None
    reason: str

    def __init__(self, choice: str, index: int | None, prefill_ttft_s: float | None,
                 decode_ttft_s: float | None, reason: str) -> None:
        self.choice = choice
        self.index = index
        self.prefill_ttft_s = prefill_ttft_s
        self.decode_ttft_s = decode_ttft_s
        self.reason = reason


def decode_ttft_s(slot: DeflectSlot, prompt_tokens: int) -> float | None:
    """The estimated time to first token of a `prompt_tokens` prompt offloaded to `slot`;
    None without a step time or a chunk size to estimate it with."""
    chunk, step_s = slot.offload_chunk, slot.offload_step_s
    if chunk <= 0 or not step_s > 0:
        return None
    return -(-(slot.offload_tokens + prompt_tokens) // chunk) * step_s


def deflect(candidates: Sequence[DeflectSlot], prompt_tokens: int,
            prefill_tokens: float | None, prefill_rate: float | None,
            handoff_s: float = HANDOFF_S) -> Deflection | None:
    """The choice for a `prompt_tokens` prompt (the module's docstring says the rule); None
    when no candidate's budget fits it (nothing to choose: the pool takes it).

    `prefill_tokens`: the predicted prefill work in flight on the pool's pick, this prompt's
    included (None: no prefill worker is active); `prefill_rate`: that worker's tokens per
    second (None: not measured). Among the candidates that fit, the lowest estimate is the
    decode side's; ties go to the most budget left, then the lowest address (as
    `policy.choose_offload`), and a candidate that cannot be estimated ranks after any that
    can."""
    best = -1
    best_key: tuple[bool, float, int, str] | None = None
    best_est: float | None = None
    for i, c in enumerate(candidates):
        budget = c.offload_budget
        left = budget - c.offload_tokens
        if budget <= 0 or prompt_tokens > left:
            continue
        est = decode_ttft_s(c, prompt_tokens)
        key = (est is None, 0.0 if est is None else est, -left, c.address)
        if best_key is None or key < best_key:
            best, best_key, best_est = i, key, est
    if best < 0:
        return None
    if prefill_tokens is None:
        return Deflection(DECODE, best, None, best_est, "no prefill worker active")
    if best_est is None:
        return Deflection(DECODE, best, None, None, "no step time in the budget: it decides")
    if prefill_rate is None or not prefill_rate > 0:
        return Deflection(PREFILL, None, None, best_est, "no prefill rate measured")
    pool_s = prefill_tokens / prefill_rate + handoff_s
    if best_est < pool_s:
        return Deflection(DECODE, best, pool_s, best_est,
                          f"decode {best_est:.4f}s < prefill {pool_s:.4f}s")
    return Deflection(PREFILL, None, pool_s, best_est,
                      f"prefill {pool_s:.4f}s <= decode {best_est:.4f}s")


def request_cost_tokens(policy: Any) -> float:
    """A request's fixed prefill cost in token units: the prefill policy's own
    (`KvAware.request_cost_tokens`), else KV-aware's default."""
    return policy.request_cost_tokens if isinstance(policy, KvAware) else DEFAULT_REQUEST_COST


def pool_side(chosen: Any, own_tokens: float, request_cost: float, rates: RateMeter,
              pool: Iterable[str]) -> tuple[float | None, float | None]:
    """(`prefill_tokens`, `prefill_rate`) for `deflect` from the prefill pool's pick: `chosen`
    (its member, this request not counted on it yet; None: no prefill worker is active), this
    prompt's own work there (`own_tokens`, the tokens taking it would count), a request's
    fixed cost in the same units (`request_cost_tokens`), the measured `rates` and the pool's
    members that take requests (read only when `chosen` has no rate of its own)."""
    if chosen is None:
        return None, None
    rate = rates.rate(chosen.address)
    if rate is None:
        keys = list(pool)
        total = rates.pool_rate(keys)
        rate = total / len(keys) if total else None
    return (chosen.in_flight_tokens + own_tokens + request_cost * (chosen.in_flight + 1),
            rate)
