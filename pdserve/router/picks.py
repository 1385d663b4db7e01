"""The router's routing choices over its worker set: which worker of a pool takes a request.

Owns `Picks`, a mixin of `pool.WorkerSet` (its `Membership` table and the lock around it, the
policies, the rate meter, the KV event feeds and the stubs): `pick()`, which builds the policy's
`RouteInput` from the ACTIVE members of a role (the prompt's chained block hashes looked up in
the block index for KV-aware prefill), asks the policy, and counts the choice in flight for the
request's duration; and the choices of a request's route (`route.Workers`, each released with
`release_taken`): `choose_prefill` and `take_prefill`, `take_offload()` for a prefill offloaded
onto a decode worker when the deflection (`deflect.py`) finds it faster than the prefill pool's
pick, and `take_cached_local()` for a prompt a decode worker caches all but a short tail of. Also
`LiveRequest`, what those choices need of a request.

Must not score workers or decide: `policy.py`, `deflect.py` and `local_prefill.py` do, as pure
functions of their inputs; nor change the membership other than counting work in flight.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from contextlib import contextmanager

from pdserve.core.block_hash import prompt_block_hashes
from pdserve.core.roles import DECODE, PREFILL
from pdserve.router.deflect import Deflection, deflect, pool_side, request_cost_tokens
from pdserve.router.local_prefill import LocalCandidate, choose_cached_local
from pdserve.router.membership import ACTIVE, Member, reports_draining
from pdserve.router.policy import KvAware, NoWorkerError, RouteInput, WorkerLoad

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class LiveRequest:
    """What the route's choices need of a request (`route.Workers`): its prompt, its tenant's
    salt, and the tokens it may add (max_tokens: a decode worker's KV must fit them)."""

    prompt_ids: Sequence[int]
    salt: str = ""
    extra_tokens: int = 0


class Picks:
    """The choices over `pool.WorkerSet`'s pools, on its state and under its lock."""

    def _prefix(self, addresses: list[str], prompt_ids: Sequence[int] | None, salt: str
                ) -> tuple[list[int], int]:
        """(leading blocks of this prompt cached per worker, leading blocks in the store)."""
        if self.feeds is None or not isinstance(self.policies[PREFILL], KvAware) or not prompt_ids:
            return [0] * len(addresses), 0
        return self._overlaps(addresses, prompt_ids, salt)

    def _overlaps(self, addresses: list[str], prompt_ids: Sequence[int], salt: str
                  ) -> tuple[list[int], int]:
        """The index's answer for this prompt (hashing a long one takes time: not under the
        lock). The engine reuses whole blocks of all prompt tokens but the last (same hashes as
        the prefill role's store lookup and the scheduler's prefix match)."""
        hashes = prompt_block_hashes(list(prompt_ids[:-1]), self.block_size_tokens, salt)
        return self.feeds.overlaps(hashes, self.block_size_tokens, addresses)

    def _input(self, pool: list[Member], local: dict[str, int], store: int, prompt_tokens: int,
               extra_tokens: int) -> RouteInput:
        workers = []
        for m in pool:
            s = m.stats
            workers.append(WorkerLoad(
                m.address, m.in_flight, True, m.in_flight_tokens, local.get(m.address, 0),
                free_blocks=None if s is None else s.num_free_blocks,
                running=0 if s is None else s.num_running, waiting=0 if s is None else s.num_waiting))
        need = -(-(prompt_tokens + extra_tokens) // self.block_size_tokens)
        return RouteInput(tuple(workers), prompt_tokens, self.block_size_tokens, store, need)

    @contextmanager
    def pick(self, role: str, prompt_ids: Sequence[int] | None = None, salt: str = "",
             extra_tokens: int = 0, exclude: frozenset[str] = frozenset()):
        """Choose an ACTIVE worker of `role` (not in `exclude`) for one request; yields
        (address, stub) and counts the request in flight until the block exits.
        `extra_tokens`: tokens the request may add (max_tokens), for decode's KV fit.
        Raises NoWorkerError when no such worker is ACTIVE."""
        address, taken = self._take(role, prompt_ids, salt, extra_tokens, exclude)
        try:
            yield address, self._stubs[address]
        finally:
            self.release_taken(address, taken)

    def _take(self, role: str, prompt_ids: Sequence[int] | None, salt: str, extra_tokens: int,
              exclude: frozenset[str], count: bool = True) -> tuple[str, tuple[float, int]]:
        """`pick`'s choice, counted in flight unless not `count`: (address, taken);
        NoWorkerError."""
        if role == PREFILL:
            with self._lock:
                addresses = [m.address for m in self.membership.pool(role)
                             if m.address not in exclude]
            # Outside the lock: hashing a long prompt takes time.
            cached, store = self._prefix(addresses, prompt_ids, salt)
            local = dict(zip(addresses, cached))
        else:
            local, store = {}, 0
        with self._lock:
            pool = [m for m in self.membership.pool(role) if m.address not in exclude]
            if not pool:
                raise NoWorkerError(f"no active {role} worker"
                                    + (f" besides {sorted(exclude)}" if exclude else ""))
            inp = self._input(pool, local, store, len(prompt_ids or ()), extra_tokens)
            d = self.policies[role].decide(inp)
            address = pool[d.index].address
            tokens = d.work_tokens if d.work_tokens is not None else inp.prompt_tokens
            if count:
                self.membership.acquire(address, tokens)
            self.last_decision = d
        if d.scores:
            log.debug("routed to %s: %s", address, d.scores)
        return address, (tokens, 0)

    # ---- route.Workers: the choices of a request's route, each released with release_taken --
    def choose_prefill(self, request: LiveRequest) -> tuple[str, tuple[float, int]] | None:
        """The prefill worker `take_prefill` would take for `request`, not counted: (address,
        what taking it counts); None when none is ACTIVE."""
        try:
            return self._take(PREFILL, request.prompt_ids, request.salt, 0, frozenset(), False)
        except NoWorkerError:
            return None

    def take_prefill(self, request: LiveRequest, exclude: frozenset[str],
                     chosen: tuple[str, tuple[float, int]] | None = None
                     ) -> tuple[str, tuple[float, int]] | None:
        """A prefill worker for `request` (not in `exclude`), counted in flight: `chosen`
        (`choose_prefill`'s answer) while it is still ACTIVE, else the policy's choice; None
        when none is ACTIVE."""
        if chosen is not None:
            with self._lock:
                address = chosen[0]
                m = self.membership.get(address) if address in self.membership else None
                if (m is not None and m.state == ACTIVE and m.role == PREFILL
                        and address not in exclude):
                    self.membership.acquire(address, chosen[1][0])
                    return chosen
        try:
            return self._take(PREFILL, request.prompt_ids, request.salt, 0, exclude)
        except NoWorkerError:
            return None

    def take_offload(self, request: LiveRequest, prefill: tuple[str, tuple[float, int]] | None
                     ) -> tuple[tuple[str, tuple[float, int], int] | None, Deflection | None]:
        """A decode worker to prefill this prompt itself within its offload budget, when it
        gives a lower estimated TTFT than `prefill`, the prefill pool's pick (`route.Workers`;
        `deflect.deflect`): ((address, taken, chunk tokens) with the prompt counted against
        the budget, or None: the pick stands; the deflection, None when no budget fits)."""
        prompt_tokens = len(request.prompt_ids)
        with self._lock:
            candidates = self.membership.offload_candidates()
            if not candidates:
                return None, None
            # A pick forgotten since (gone): no prefill worker to weigh.
            gone = prefill is None or prefill[0] not in self.membership
            tokens, rate = pool_side(
                None if gone else self.membership.get(prefill[0]),
                0.0 if prefill is None else prefill[1][0],
                request_cost_tokens(self.policies[PREFILL]), self.rates,
                (m.address for m in self.membership.pool(PREFILL) if not reports_draining(m)))
            d = deflect(candidates, prompt_tokens, tokens, rate, self.handoff_s)
            if d is None or d.index is None:
                return None, d
            m = candidates[d.index]
            self.membership.acquire(m.address, 0.0, prompt_tokens)
            return (m.address, (0.0, prompt_tokens), m.offload_chunk), d

    def take_cached_local(self, request: LiveRequest, max_uncached_tokens: int
                          ) -> tuple[str, tuple[float, int], int] | None:
        """A decode worker whose prefix cache holds all but at most `max_uncached_tokens` of
        this prompt, to prefill the rest itself (`local_prefill.choose_cached_local`):
        (address, taken, tokens it caches), counted in flight; None (no KV index, or no worker
        qualifies)."""
        prompt_ids = request.prompt_ids
        if self.feeds is None or max_uncached_tokens <= 0 or not prompt_ids:
            return None
        with self._lock:
            addresses = [m.address for m in self.membership.pool(DECODE)]
        if not addresses:
            return None
        cached, _ = self._overlaps(addresses, prompt_ids, request.salt)  # outside the lock
        blocks = dict(zip(addresses, cached))
        need = -(-(len(prompt_ids) + request.extra_tokens) // self.block_size_tokens)
        with self._lock:
            pool = self.membership.pool(DECODE)
            candidates = [LocalCandidate(
                m.address, blocks.get(m.address, 0) * self.block_size_tokens,
                running=0 if m.stats is None else m.stats.num_running,
                waiting=0 if m.stats is None else m.stats.num_waiting,
                free_blocks=None if m.stats is None else m.stats.num_free_blocks)
                for m in pool]
            c = choose_cached_local(candidates, len(prompt_ids), max_uncached_tokens, need)
            if c is None:
                return None
            address = candidates[c.index].address
            self.membership.acquire(address, c.uncached_tokens)
            return address, (float(c.uncached_tokens), 0), c.cached_tokens

    def release_taken(self, address: str, taken: tuple[float, int]) -> None:
        """Stop counting what a `take_*` or `pick` counted on `address`."""
        with self._lock:
            self.membership.release(address, taken[0], taken[1])
