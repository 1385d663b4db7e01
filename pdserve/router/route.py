"""A request's route through the cluster, as a pure core: which path it takes, and what happens
after a hop fails. The live router (`service.py`) and the simulator (`sim/arrival.py`) both
call it, so they take the same paths in the same order.

Owns the order of choices at arrival (`plan`): a decode worker that caches all but a short
tail of the prompt prefills and decodes it (CACHED_LOCAL: conditional disaggregation, when
`max_local_prefill_tokens` > 0); else the prefill pool's pick is weighed against the decode
workers whose offload budget fits the prompt (`deflect.deflect`: the lower estimated time to
first token), and either a decode worker prefills it in bounded chunks and decodes on
(OFFLOAD) or the prefill worker prefills and a decode worker decodes (DISAGGREGATED); else,
with no prefill worker to take it, a decode worker prefills it itself (DECODE_FALLBACK).
Admission (a request refused before any of this) is the door's (`lifecycle.Door`). And
the rule after a failure (`after_failure`): a hop re-routed to another worker of its pool while
`retry.RetryPolicy` allows and it has sent the client nothing; a local hop (cached-local or
offload) refused that way falls through to the next path; a prefill that gave up falls back to
a decode worker; a decode stream that broke after sending tokens is resumed on another decode
worker; anything else gives up with the status `retry.client_status` names.
The choices themselves are the `Workers` interface's (`pool.WorkerSet` live, the simulated
cluster's router in `sim/`): they pick a worker with the routing policies and count the
request on it until released.
Must not do I/O, sleep or read a clock: the caller passes what it knows and carries out the
decision (waits the delay, calls the worker, releases what it took).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pdserve.router.retry import RetryPolicy, client_status

# Paths (`Route.kind`), in the order `plan` tries them.
CACHED_LOCAL = "cached_local"
OFFLOAD = "offload"
DISAGGREGATED = "disaggregated"
DECODE_FALLBACK = "decode_fallback"
_ORDER = (CACHED_LOCAL, OFFLOAD, DISAGGREGATED)

# Hops (`Failure.hop`): what failed.
PREFILL_HOP = "prefill"
DECODE_HOP = "decode"
LOCAL_HOP = "local"  # a decode worker prefilling and decoding (cached-local, offload)

# What to do after a failure (`Next.action`).
RETRY = "retry"  # the same hop on another worker of its pool (after `delay_s`)
FALL_THROUGH = "fall_through"  # a local hop refused: plan on from the next path
FALLBACK = "fallback"  # the prefill hop gave up: a decode worker prefills the prompt
RESUME = "resume"  # a decode stream broke after tokens: resume it on another decode worker
GIVE_UP = "give_up"  # the client gets `status` (None: the client left, nothing to send)


@dataclass(frozen=True, slots=True)
class Route:
    """A path, with what its first hop took: `address` (the worker chosen; "" for
    DECODE_FALLBACK), `taken` (whatever the `Workers` implementation needs to release it:
    counts, a stub), for the local paths the chunk a step (OFFLOAD) or the tokens the
    worker caches (CACHED_LOCAL), and the prefill deflection's choice when an offload budget
    fit the prompt (`deflect.Deflection`; None: none fit, or no choice was made)."""

    kind: str
    address: str = ""
    taken: Any = None
    chunk_tokens: int = 0
    cached_tokens: int = 0
    deflection: Any = None


class Workers(Protocol):
    """The choices a route needs, each counting the request on the worker it returns (the
    caller releases `taken` when the hop ends); `choose_prefill` only names one."""

    def take_cached_local(self, request, max_uncached_tokens: int
                          ) -> tuple[str, Any, int] | None:
        """(address, taken, tokens it caches) of a decode worker caching all but at most
        `max_uncached_tokens` of the prompt, or None."""

    def choose_prefill(self, request) -> tuple[str, Any] | None:
        """(address, taken) of the prefill worker `take_prefill` would take, not counted (the
        deflection weighs it), or None: none is active."""

    def take_offload(self, request, prefill: tuple[str, Any] | None
                     ) -> tuple[tuple[str, Any, int] | None, Any]:
        """(take, deflection): `deflect.deflect` over the decode workers whose offload
        budget fits the prompt against `prefill`, the prefill pool's pick (`choose_prefill`'s
        answer; None: no prefill worker is active). take: (address, taken, chunk tokens a
        step) of the decode worker chosen, counted; None when none was (the pool's pick
        stands). deflection: the choice, None when no budget fit."""

    def take_prefill(self, request, exclude: frozenset[str],
                     chosen: tuple[str, Any] | None = None) -> tuple[str, Any] | None:
        """(address, taken) of a prefill worker not in `exclude` (`chosen`, from
        `choose_prefill`, while it still can), or None: none is active."""


def plan(workers: Workers, request, max_local_prefill_tokens: int, after: str = "") -> Route:
    """The path for `request`, trying the paths after `after` ("": all) in order; with no
    prefill worker, DECODE_FALLBACK (`RetryPolicy.prefill_fallback`). OFFLOAD and
    DISAGGREGATED are one choice: the prefill pool's pick first (not counted yet), then the
    deflection (`Workers.take_offload`) sends the request to a decode worker or leaves it to
    that pick (`take_prefill` counts it)."""
    start = _ORDER.index(after) + 1 if after else 0
    for kind in _ORDER[start:]:
        if kind == CACHED_LOCAL:
            if max_local_prefill_tokens <= 0:
                continue
            local = workers.take_cached_local(request, max_local_prefill_tokens)
            if local is not None:
                return Route(CACHED_LOCAL, local[0], local[1], cached_tokens=local[2])
        elif kind == OFFLOAD:
            chosen = workers.choose_prefill(request)
            off, deflection = workers.take_offload(request, chosen)
            if off is not None:
                return Route(OFFLOAD, off[0], off[1], chunk_tokens=off[2],
                             deflection=deflection)
            pre = None if chosen is None else workers.take_prefill(request, frozenset(), chosen)
            if pre is not None:
                return Route(DISAGGREGATED, pre[0], pre[1], deflection=deflection)
            return Route(DECODE_FALLBACK, deflection=deflection)
        else:
            pre = workers.take_prefill(request, frozenset())
            if pre is not None:
                return Route(DISAGGREGATED, pre[0], pre[1])
    return Route(DECODE_FALLBACK)


@dataclass(frozen=True, slots=True)
class Failure:
    """A hop that did not finish: which (`hop`), where (`address`; "" when no worker of its
    pool could be picked), with what status name (`code`; None: no worker to pick), its
    attempt number on this hop (1-based), whether it had sent the client tokens, how many
    times the request was resumed before, the request's deadline left, whether the client
    left, and whether workers were left out of this hop already (`excluded`)."""

    hop: str
    code: str | None
    address: str = ""
    attempt: int = 1
    relayed: bool = False
    resumes: int = 0
    remaining_s: float | None = None
    client_left: bool = False
    excluded: bool = False


@dataclass(frozen=True, slots=True)
class Next:
    """What to do after a failure: `action` (RETRY, FALL_THROUGH, FALLBACK, RESUME, GIVE_UP),
    the wait before it, the status the client gets when giving up (None: it left), and why."""

    action: str
    delay_s: float = 0.0
    status: str | None = None
    reason: str = ""
    # RETRY after no worker was left to pick: try the workers left out again.
    clear_excluded: bool = False


def after_failure(failure: Failure, retry: RetryPolicy) -> Next:
    """The decision after `failure` (`route.py`'s docstring says the rules)."""
    f = failure
    if f.code == "CANCELLED" and f.client_left:
        return Next(GIVE_UP, status=None, reason="the client left")
    if f.code is None:  # no worker of the hop's pool to pick
        if f.client_left:
            return Next(GIVE_UP, status="UNAVAILABLE", reason="the client left")
        if f.excluded:  # each left out once: they may serve a moment later
            return Next(RETRY, clear_excluded=True, reason="every worker left out once")
        if f.hop == PREFILL_HOP and retry.prefill_fallback(None):
            return Next(FALLBACK, reason="no prefill worker")
        return Next(GIVE_UP, status="UNAVAILABLE", reason=f"no {f.hop} worker")
    if not f.relayed and not f.client_left:
        d = retry.decide(f.attempt, f.code, f.remaining_s, False)
        if d.retry:
            return Next(FALL_THROUGH if f.hop == LOCAL_HOP else RETRY, d.delay_s,
                        reason=d.reason)
    if f.hop == PREFILL_HOP:
        if not f.client_left and retry.prefill_fallback(f.code):
            return Next(FALLBACK, reason=f"prefill gave up with {f.code}")
        return Next(GIVE_UP, status=client_status(f.code), reason=f"prefill: {f.code}")
    d = retry.decide_resume(f.resumes, f.code, f.remaining_s, f.client_left)
    if d.retry:
        return Next(RESUME, d.delay_s, reason=d.reason)
    return Next(GIVE_UP, status=client_status(f.code), reason=d.reason)
