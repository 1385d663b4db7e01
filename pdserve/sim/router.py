"""The router as the simulator runs it: the real membership, routing, admission and KV index
cores, fed the way the router's worker set (`router/pool.py`, `router/picks.py`) feeds them.

Owns the simulated router's state: the `Membership` table, one policy per role (`make_policy`),
`Admission`, the `KvIndex` (sources: each worker's prefix cache, and the store unless the store
is read where it is), the prefill rate meter, the conditional-disaggregation choice
(`cached_local`, through `local_prefill.choose_cached_local`), the prefill deflection
(`offload`, through `deflect.deflect`, fed as `WorkerSet.take_offload` feeds it), and a cache
of each member's `WorkerLoad` rebuilt only when that member changes (acquire, release, a stats
report), so a choice among a thousand workers costs the policy's own work and little more.
Must not score or choose itself: `pick` builds the `RouteInput` (field by field as
`picks.Picks._input` does) and the policy decides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.core.rates import RateMeter
from pdserve.router.admission import Admission
from pdserve.router.deflect import (HANDOFF_S, Deflection, deflect, pool_side,
                                    request_cost_tokens)
from pdserve.router.kv_index import CLEARED, REMOVED, STORED, KvEvent, KvIndex, store_source
from pdserve.router.local_prefill import LocalCandidate, choose_cached_local
from pdserve.core.roles import ACTIVE, DECODE, PREFILL
from pdserve.router.membership import Membership, reports_draining
from pdserve.router.policy import (DecodeChooser, KvAware, LoadOrder, NoWorkerError,
                                   RouteDecision, RouteInput, WorkerLoad, make_policy)
from pdserve.sim.config import SimConfig

if TYPE_CHECKING:
    from pdserve.sim.network import KvStore as StoreView

MODEL_ID = "sim"
STORE = store_source(MODEL_ID)


class SimRouter:
    def __init__(self, cfg: SimConfig, addresses: dict[str, str], now: float = 0.0,
                 store: StoreView | None = None) -> None:
        self.cfg = cfg
        # The shared store's blocks: a source of the index fed by `store_events`, or (`store`
        # given) read where they are. The two answer alike (events reach the index as the store
        # changes) while the store holds no more than the index's bound per source, the store's
        # default capacity; reading the store spares the index a second copy of its blocks.
        self.store = store
        self.membership = Membership()
        self.policies = {PREFILL: make_policy(cfg.prefill_policy, seed=cfg.seed),
                         DECODE: make_policy(cfg.decode_policy, seed=cfg.seed + 1)}
        self.kv_aware = isinstance(self.policies[PREFILL], KvAware)
        self.admission = Admission(cfg.admission)
        # Past a few dozen workers, finding a prompt's holders by hash beats asking every
        # worker, though the by-hash map costs upkeep on every block change; the store, which
        # takes most new blocks, is asked directly instead.
        self.index = KvIndex(max_blocks_per_source=10_000_000,
                             max_sources=len(addresses) + 1, by_hash=len(addresses) > 64,
                             scanned=(STORE,) if store is None else ())
        self.rates = RateMeter()
        self.handoff_s = HANDOFF_S  # the live router's default (`WorkerSet`)
        self.block_size = cfg.block_size
        self._loads: dict[str, WorkerLoad] = {}
        self._pools: dict[str, list[str]] = {}
        # Per role whose policy decides from orders (KV-aware prefill, free-KV decode): the
        # pool's loads (aligned with `pool(role)`) and the orders its `decide_sparse` reads,
        # kept current by `_touch`; rebuilt after a membership change.
        self._sparse = {role: self._order_keys(p) is not None for role, p in self.policies.items()}
        self._views: dict[str, tuple[dict[str, int], list[WorkerLoad], list[LoadOrder]]] = {}
        self.last_decision: RouteDecision | None = None
        self._budgets = False  # whether any offload budget stands
        for address, role in sorted(addresses.items()):
            self.membership.join(address, role, now)
            self._touch(address)

    # ---- membership ----------------------------------------------------------------------------
    def _touch(self, address: str) -> None:
        m = self.membership.get(address)
        s = m.stats
        free, running, waiting = ((None, 0, 0) if s is None else
                                  (s.num_free_blocks, s.num_running, s.num_waiting))
        old = self._loads.get(address)
        if (old is not None and old.in_flight == m.in_flight
                and old.in_flight_tokens == m.in_flight_tokens and old.free_blocks == free
                and old.running == running and old.waiting == waiting):
            return  # the same load (a poll of an unchanged worker): views and orders hold
        w = self._loads[address] = WorkerLoad(  # positional: no keywords to parse
            m.address, m.in_flight, True, m.in_flight_tokens, 0, free, running, waiting)
        for role, (at, loads, orders) in self._views.items():
            i = at.get(address)
            if i is not None:
                loads[i] = w
                for order, key in zip(orders, self._order_keys(self.policies[role], w)):
                    order.set(i, *key)

    @staticmethod
    def _order_keys(policy, w: WorkerLoad | None = None):
        """The keys of `w` in the orders the policy's `decide_sparse` reads; None if it has
        no such form (with no `w`: whether it has)."""
        if isinstance(policy, KvAware):
            return [(policy.load_of(w), w.in_flight)] if w is not None else []
        if isinstance(policy, DecodeChooser):
            return [policy.by_batch(w), policy.by_free(w)] if w is not None else []
        return None

    def _pools_changed(self) -> None:
        self._pools.clear()
        self._views.clear()

    def _view(self, role: str) -> tuple[dict[str, int], list[WorkerLoad], list[LoadOrder]]:
        v = self._views.get(role)
        if v is None:
            addresses = self.pool(role)
            loads = [self._loads[a] for a in addresses]
            policy = self.policies[role]
            orders = [LoadOrder() for _ in self._order_keys(policy, self._loads[addresses[0]])
                      ] if addresses else []
            for i, w in enumerate(loads):
                for order, key in zip(orders, self._order_keys(policy, w)):
                    order.set(i, *key)
            v = self._views[role] = ({a: i for i, a in enumerate(addresses)}, loads, orders)
        return v

    def members(self) -> list:
        """Every member, by address (what the router's control API lists)."""
        return [dataclasses.replace(m) for m in self.membership.members()]

    def pool(self, role: str) -> list[str]:
        """ACTIVE members of `role`, by address (`Membership.pool`, cached until a change)."""
        p = self._pools.get(role)
        if p is None:
            p = self._pools[role] = [m.address for m in self.membership.pool(role)]
        return p

    def set_state(self, address: str, state: str, role: str | None, reason: str,
                  now: float) -> None:
        self.membership.set_state(address, state, role, reason, now=now)
        self._pools_changed()
        self._touch(address)

    def report(self, address: str, role: str, stats, now: float) -> None:
        """A stats poll's answer (a `WorkerStats` message) from `address`."""
        before = self.membership.get(address)
        was = (before.state, before.role)
        m = self.membership.report(address, role, now, stats, now)
        if m is not None and role == PREFILL:
            self.rates.observe(address, stats.prompt_tokens_computed, stats.busy_seconds)
        else:
            self.rates.forget(address)
        if m is not None and (m.state, m.role) != was:
            self._pools_changed()
        self._touch(address)

    def prefill_rate(self) -> float | None:
        return self.rates.pool_rate((a for a in self.pool(PREFILL)
                                     if not reports_draining(self.membership.get(a))), peak=True)

    # ---- the KV index --------------------------------------------------------------------------
    def kv_event(self, source: str, kind: str, hashes) -> None:
        if hashes or kind == CLEARED:
            self.index.apply(KvEvent(source, kind, tuple(hashes)))

    def worker_events(self, address: str, events) -> None:
        """A worker's prefix-cache changes, in order: [(STORED | REMOVED, hash)]."""
        self.index.apply_changes(address, events)

    def resync(self, address: str, hashes) -> None:
        """A worker's prefix cache from a snapshot (its hashes, oldest first)."""
        self.kv_event(address, CLEARED, ())
        self.kv_event(address, STORED, hashes)

    def store_events(self, stored, evicted) -> None:
        """The store stored and evicted these blocks (read where they are with `store`)."""
        if self.store is not None:
            return
        self.kv_event(STORE, STORED, stored)
        self.kv_event(STORE, REMOVED, evicted)

    # ---- choices -------------------------------------------------------------------------------
    def prefix(self, hashes) -> tuple[dict[int, int], int]:
        """({index in the prefill pool: leading blocks it caches} for the workers caching
        some, leading blocks in the store), as the router's block index knows them; empty
        unless the prefill policy is KV-aware."""
        if not self.kv_aware or not hashes:
            return {}, 0
        at = self._view(PREFILL)[0]
        held = self.index.holders(hashes)
        store = held.pop(STORE, 0) if self.store is None else self.store.overlap(hashes)
        return {at[a]: c for a, c in held.items() if a in at}, store

    def route_input(self, role: str, prompt_tokens: int, extra_tokens: int
                    ) -> tuple[list[str], RouteInput]:
        addresses = self.pool(role)
        if not addresses:
            raise NoWorkerError(f"no active {role} worker")
        workers: Sequence[WorkerLoad]
        if self._sparse[role]:
            workers = self._view(role)[1]
        else:
            loads = self._loads
            workers = tuple(loads[a] for a in addresses)
        need = -(-(prompt_tokens + extra_tokens) // self.block_size)
        return addresses, RouteInput(workers, prompt_tokens, self.block_size, 0, need)

    def pick(self, role: str, prompt_tokens: int, extra_tokens: int = 0, hashes=(),
             exclude: frozenset[str] = frozenset(), count: bool = True) -> tuple[str, float]:
        """The chosen member and the tokens counted in flight on it (release them at the end;
        not `count`: the tokens counting it would count, nothing counted). `exclude`: members
        left out, for a decode choice (a moved decode resumes elsewhere), as the live
        `WorkerSet.pick` leaves them out. Raises NoWorkerError."""
        addresses, inp = self.route_input(role, prompt_tokens, extra_tokens)
        policy = self.policies[role]
        if exclude:
            assert role == DECODE, "only decode choices leave members out here"
            kept = [k for k, a in enumerate(addresses) if a not in exclude]
            if not kept:
                raise NoWorkerError(f"no active {role} worker besides {sorted(exclude)}")
            d = policy.decide(RouteInput(tuple(inp.workers[k] for k in kept), inp.prompt_tokens,
                                         inp.block_size_tokens, 0, inp.need_blocks))
            addresses = [addresses[k] for k in kept]
        elif role == PREFILL and self.kv_aware:
            cached, store = self.prefix(hashes)
            inp = RouteInput(inp.workers, inp.prompt_tokens, inp.block_size_tokens, store,
                             inp.need_blocks)  # as `dataclasses.replace` would, more cheaply
            d = policy.decide_sparse(inp, cached, *self._view(role)[2])
        elif self._sparse[role]:
            d = policy.decide_sparse(inp, *self._view(role)[2])
        else:
            d = policy.decide(inp)
        self.last_decision = d
        address = addresses[d.index]
        tokens = d.work_tokens if d.work_tokens is not None else inp.prompt_tokens
        if count:
            self.count(address, tokens)
        return address, tokens

    def count(self, address: str, tokens: float) -> None:
        """A request sent to `address`, its predicted prefill work `tokens`: in flight."""
        self.membership.acquire(address, tokens)
        self._touch(address)

    def cached_local(self, cached: dict[str, int], prompt_tokens: int, extra_tokens: int,
                     max_uncached_tokens: int) -> tuple[str, int] | None:
        """A decode worker caching all but at most `max_uncached_tokens` of the prompt, to
        prefill the rest itself: (address, tokens counted in flight: the uncached ones), or
        None. `cached`: the leading blocks of the prompt that decode workers cache (those not
        named cache none), the index's answer `WorkerSet.cached_local` asks for. Candidates
        are the ACTIVE decode workers caching some, in the pool's order (`choose_cached_local`
        passes over the others)."""
        if max_uncached_tokens <= 0 or not cached:
            return None
        bs = self.block_size
        candidates = []
        for a in self.pool(DECODE):
            n = cached.get(a)
            if n:
                s = self.membership.get(a).stats
                candidates.append(LocalCandidate(
                    a, n * bs, running=0 if s is None else s.num_running,
                    waiting=0 if s is None else s.num_waiting,
                    free_blocks=None if s is None else s.num_free_blocks))
        need = -(-(prompt_tokens + extra_tokens) // bs)
        c = choose_cached_local(candidates, prompt_tokens, max_uncached_tokens, need)
        if c is None:
            return None
        address = candidates[c.index].address
        self.membership.acquire(address, c.uncached_tokens)
        self._touch(address)
        return address, c.uncached_tokens

    def offload(self, prompt_tokens: int, prefill: tuple[str, tuple[float, int]] | None
                ) -> tuple[tuple[str, int] | None, Deflection | None]:
        """A decode worker to prefill the prompt itself within its budget, when the deflection
        finds it faster than `prefill`, the prefill pool's pick, not counted (as
        `WorkerSet.take_offload`): ((address, chunk), or None), and the deflection (None: no
        budget fits)."""
        if not self._budgets:  # no budget stands: no candidate (saves a pass over members)
            return None, None
        candidates = self.membership.offload_candidates()
        if not candidates:
            return None, None
        tokens, rate = pool_side(
            None if prefill is None else self.membership.get(prefill[0]),
            0.0 if prefill is None else prefill[1][0],
            request_cost_tokens(self.policies[PREFILL]), self.rates,
            (a for a in self.pool(PREFILL) if not reports_draining(self.membership.get(a))))
        d = deflect(candidates, prompt_tokens, tokens, rate, self.handoff_s)
        if d is None or d.index is None:
            return None, d
        m = candidates[d.index]
        self.membership.acquire(m.address, 0.0, prompt_tokens)
        self._touch(m.address)
        return (m.address, m.offload_chunk), d

    # ---- a request's route (`router/route.py`): the live `WorkerSet.take_*`, in the
    # simulator's terms (the prompt by its token count and block hashes; `cached`: what each
    # decode worker's cache holds of it, as `cached_local` takes it) ----------------------------
    def take_cached_local(self, cached: dict[str, int], prompt_tokens: int, extra_tokens: int,
                          max_uncached_tokens: int) -> tuple[str, tuple[float, int], int] | None:
        local = self.cached_local(cached, prompt_tokens, extra_tokens, max_uncached_tokens)
        if local is None:
            return None
        return local[0], (local[1], 0), cached[local[0]] * self.block_size

    def take_offload(self, prompt_tokens: int, prefill: tuple[str, tuple[float, int]] | None
                     ) -> tuple[tuple[str, tuple[float, int], int] | None, Deflection | None]:
        chosen, d = self.offload(prompt_tokens, prefill)
        return (None if chosen is None else (chosen[0], (0.0, prompt_tokens), chosen[1])), d

    def choose_prefill(self, prompt_tokens: int, hashes) -> tuple[str, tuple[float, int]] | None:
        try:
            address, tokens = self.pick(PREFILL, prompt_tokens, 0, hashes, count=False)
        except NoWorkerError:
            return None
        return address, (tokens, 0)

    def take_prefill(self, prompt_tokens: int, hashes,
                     chosen: tuple[str, tuple[float, int]] | None = None
                     ) -> tuple[str, tuple[float, int]] | None:
        """`chosen` (`choose_prefill`'s answer) counted, else the policy's choice."""
        if chosen is not None:  # a simulated pick cannot leave the pool before it is counted
            self.count(chosen[0], chosen[1][0])
            return chosen
        try:
            address, tokens = self.pick(PREFILL, prompt_tokens, 0, hashes)
        except NoWorkerError:
            return None
        return address, (tokens, 0)

    def release(self, address: str, tokens: float = 0.0, offload_tokens: int = 0) -> None:
        self.membership.release(address, tokens, offload_tokens)
        self._touch(address)

    def set_budgets(self, budgets: dict[str, tuple]) -> None:
        """address -> (max tokens, chunk tokens[, step_s]), as `Membership` takes them."""
        self.membership.set_offload_budgets(budgets)
        self._budgets = any(b[0] > 0 for b in budgets.values())

    def active(self, address: str) -> bool:
        return self.membership.get(address).state == ACTIVE
