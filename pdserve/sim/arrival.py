"""A request's arrival in the simulated cluster, up to its entry into a worker's engine.

Owns `Arrivals`, the cluster's `arrive` event: admission (the in-flight bound, then the
predicted-TTFT bound and its prefill ticket), the live router's route (`route.plan`, over this
class as its `route.Workers`: the simulated router's choices for request `i`), and the path
taken: a decode worker that caches all but a short tail, or takes an offload, prefills and
decodes it; with no prefill worker a decode worker takes it whole (`route.after_failure`'s
FALLBACK); else the prefill worker, after a fetch of the blocks the store holds past its prefix
cache (`to_prefill` once it landed). Also which decode workers' caches can qualify for
conditional disaggregation (`_decode_cached`).
Must not score, admit or choose itself (the simulated router's cores do), nor step workers or
move KV (the cluster's events do).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdserve.core.roles import DECODE
from pdserve.router.admission import Overloaded
from pdserve.router.policy import NoWorkerError
from pdserve.router.route import (CACHED_LOCAL, DECODE_FALLBACK, FALLBACK, OFFLOAD, PREFILL_HOP,
                                  Failure, after_failure, plan)
from pdserve.sim.prompts import RequestPrompt

if TYPE_CHECKING:
    from pdserve.sim.cluster import Cluster
    from pdserve.sim.worker import SimWorker

# The route's event when no prefill worker can take a request (`route.after_failure`).
_NO_PREFILL = Failure(PREFILL_HOP, None)


class Arrivals:
    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster
        self._decode_caches: tuple = (None, [])  # the decode pool; its engines and their caches
        self.store_hits: dict[int, tuple[int, int]] = {}

    def _reject(self, i: int, reason: str) -> None:
        c = self.c
        c._resolved(i, f"rejected: {reason}")
        c.hashes.pop(i, None)
        c.known.pop(i, None)

    def arrive(self, i: int) -> None:
        c = self.c
        now, router = c.q.now, c.router
        r = c.reqs[i]
        c.arrived = i + 1
        if i + 1 < len(c.arrivals):
            c.q.push(max(now, c.arrivals[i + 1]), "arrive", i + 1)
        try:
            router.admission.admit("", now)
        except Overloaded as e:
            self._reject(i, e.reason)
            return
        if c.connector is not None:
            c.connector.started(r.output_tokens)
        # The full blocks' hashes come from the trace's block ids (the scheduler takes them as
        # known); the router's are those of the reusable blocks (all tokens but the last).
        known = c.known[i] = RequestPrompt(c.reqs, i, r.prompt_tokens, c.cfg.block_size,
                                           c.cfg.prefix_block_tokens)
        hashes = c.hashes[i] = known[:(r.prompt_tokens - 1) // c.cfg.block_size]
        if c.cfg.admission.max_predicted_ttft_s > 0:
            cached, store = router.prefix(hashes)
            own = max(1, r.prompt_tokens - max([store, *cached.values()]) * c.cfg.block_size)
            try:
                ticket = router.admission.admit_prefill(own, router.prefill_rate(), c.q.now)
            except Overloaded as e:
                router.admission.release("")
                self._reject(i, e.reason)
                return
            c.own[i] = ticket
        # The live router's route (`router/route.py`), through these `Workers`.
        route = plan(self, i, c.cfg.max_local_prefill_tokens)
        kind, address = route.kind, route.address
        if route.deflection is not None:
            c.counts["deflections_" + route.deflection.choice] += 1
        if c.connector is not None:
            c.routes[i] = route
        if kind == CACHED_LOCAL:  # conditional disaggregation: it caches all but a short tail
            c.held[i] = (address, route.taken[0], 0)
            c.counts["local_prefills"] += 1
            self._on_decode(i, address)
            return
        if kind == OFFLOAD:
            c.held[i] = (address, 0.0, r.prompt_tokens)
            c.counts["offloaded"] += 1
            c.offloaded.add(i)
            self._on_decode(i, address, route.chunk_tokens)
            return
        if kind == DECODE_FALLBACK:  # no prefill worker: a decode worker prefills it
            if (after_failure(_NO_PREFILL, c.retry).action == FALLBACK
                    and self._prefill_on_decode(i)):
                return
            router.admission.release("")
            c._prefilled(i, answered=False)
            self._reject(i, "no prefill worker")
            return
        tokens = route.taken[0]
        c.held[i] = (address, tokens, 0)
        c.report.prefill_worker[i] = address
        w = c.workers[address]
        here = w.engine.cached_blocks(hashes)
        in_store = c.store.leading(hashes) if c.store.capacity else 0
        self.store_hits[i] = (here, in_store)
        if in_store > here:
            w.inbound += 1
            c.counts["store_fetch_blocks"] += in_store - here
            c._send(c.links[address], ("fetch", i, address), (in_store - here) * c.bpt)
        else:
            self.to_prefill(w, i)

    # ---- route.Workers: the simulated router's choices for request `i` -----------------------
    def take_cached_local(self, i: int, max_uncached_tokens: int
                          ) -> tuple[str, tuple[float, int], int] | None:
        c = self.c
        r = c.reqs[i]
        return c.router.take_cached_local(self._decode_cached(c.hashes[i], r.prompt_tokens),
                                          r.prompt_tokens, r.output_tokens,
                                          max_uncached_tokens)

    def take_offload(self, i: int, prefill: tuple[str, tuple[float, int]] | None
                     ) -> tuple[tuple[str, tuple[float, int], int] | None, Any]:
        return self.c.router.take_offload(self.c.reqs[i].prompt_tokens, prefill)

    def choose_prefill(self, i: int) -> tuple[str, tuple[float, int]] | None:
        return self.c.router.choose_prefill(self.c.reqs[i].prompt_tokens, self.c.hashes[i])

    def take_prefill(self, i: int, exclude: frozenset[str],
                     chosen: tuple[str, tuple[float, int]] | None = None
                     ) -> tuple[str, tuple[float, int]] | None:
        # `exclude` is always empty here: a simulated prefill never fails, so none is retried.
        return self.c.router.take_prefill(self.c.reqs[i].prompt_tokens, self.c.hashes[i], chosen)

    def _decode_cached(self, hashes: list[bytes], prompt_tokens: int) -> dict[str, int]:
        """{ACTIVE decode worker: leading blocks of `hashes` its prefix cache holds} for those
        that can leave at most `max_local_prefill_tokens` uncached: they hold the chain up to
        its block `m` (so block `m` itself); a worker without it cannot qualify and is left
        out (a lookup per worker, not a walk of each one's chain)."""
        c = self.c
        bs, limit = c.cfg.block_size, c.cfg.max_local_prefill_tokens
        m = max(0, -(-(prompt_tokens - limit) // bs) - 1)
        if m >= len(hashes):
            return {}
        h = hashes[m]
        pool = c.router.pool(DECODE)  # the same list until the membership changes
        if self._decode_caches[0] is not pool:
            self._decode_caches = (pool, [(a, c.workers[a].engine,
                                           c.workers[a].engine.pool.by_hash) for a in pool])
        if h not in c._decode_held:
            return {}
        return {a: engine.cached_blocks(hashes) for a, engine, cached in self._decode_caches[1]
                if h in cached}

    # ---- the request enters a worker ----------------------------------------------------------
    def _prefill_on_decode(self, i: int) -> bool:
        """No prefill worker: a decode worker takes the whole request (False: none can)."""
        c = self.c
        r = c.reqs[i]
        try:
            address, tokens = c.router.pick(DECODE, r.prompt_tokens, r.output_tokens)
        except NoWorkerError:
            return False
        c.held[i] = (address, tokens, 0)
        self._on_decode(i, address)
        return True

    def _on_decode(self, i: int, address: str, chunk: int = 0) -> None:
        """The request prefills and decodes on decode worker `address` (its counts held)."""
        c = self.c
        w, output_tokens = c.workers[address], c.reqs[i].output_tokens
        c.report.prefill_worker[i] = c.report.decode_worker[i] = address
        known = c.known.pop(i)
        c.hashes.pop(i, None)  # not read again: no hand-over
        c._join(w, lambda: w.engine.add(str(i), known, output_tokens, max_chunk_tokens=chunk))

    def to_prefill(self, w: SimWorker, i: int) -> None:
        """The request enters prefill worker `w` (its store fetch, if any, landed)."""
        c = self.c
        local, in_store = self.store_hits.pop(i, (0, 0))
        # Not read again before the hand-over (which names its blocks by the prefill's).
        hashes, known = c.hashes.pop(i), c.known.pop(i)

        def enter() -> None:
            if in_store > local:
                w.engine.import_cached(hashes[local:in_store])
            w.engine.add(str(i), known, 1, prefill_only=True)

        c._join(w, enter)
