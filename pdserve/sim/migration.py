"""Running decodes moved with their KV in the simulated cluster (live migration), as the live
decode worker moves them (`worker/decode/migrate.py`) and the live router resumes them.

Owns the moves, in rounds: a round takes requests off one decode worker, all of a draining
worker's (a flip with `migrate`, reason "drain": a new round for those that joined meanwhile,
until none is left) or the `count` with the most tokens left (the controller's balance,
`most_left`: the worker keeps its role), and in the live worker's order:
1. pre-copy: between two steps, the full blocks they have that the store lacks are put over the
   worker's link while they keep decoding;
2. stop: at the first step boundary after the pre-copy landed, all of the round's requests
   leave the engine together (those that finished meanwhile are skipped);
3. their blocks completed since are put over the same link;
4. resume: each is taken by the router's decode choice, never the worker it left (the live
   router's `WorkerSet.pick(DECODE, exclude=...)`, through `SimRouter.pick`), which fetches over
   its own link the blocks the store holds past those its prefix cache has, and queues the
   request with every token it had (the engine's resume: what the prefix cache holds is not
   computed again, only the last, partial block, and what the store lost).
Counts moves by reason, the bytes put and fetched, the tokens computed again (as the live
decode worker counts them: what neither its prefix cache nor the store held), and each moved
request's stall (from the stop, its last token there, to its first token on the next worker, in
the report). A balance's outcome (`MigrateOutcome`) is handed back once its requests were
resumed, on the virtual clock.
Must not choose where a request goes (the router's policy does) nor when to move (the
controller does); the cluster calls it at its events.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from pdserve.controller.flip import MigrateOutcome
from pdserve.core.migration import DRAIN, most_left
from pdserve.core.roles import DECODE, DRAINING, SERVING
from pdserve.router.policy import NoWorkerError

if TYPE_CHECKING:
    from pdserve.sim.cluster import Cluster
    from pdserve.sim.worker import SimWorker

# The link transfers of a round (keyed by its number) and of one request's fetch.
COPY, PUT, FETCH = "migrate_copy", "migrate_put", "migrate_fetch"


class _Round:
    __slots__ = ("address", "reason", "requested", "done", "started_s", "copied", "moved",
                 "last")

    def __init__(self, address: str, reason: str, requested: int, done, started_s: float
                 ) -> None:
        self.address, self.reason, self.requested = address, reason, requested
        self.done, self.started_s = done, started_s
        self.copied: dict[str, int] = {}  # request id -> full blocks pre-copied
        self.moved: list[tuple] = []  # (request index, prompt, token ids, known, full hashes)
        self.last: list[bytes] = []  # blocks put after the stop


class Migrations:
    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster
        self.draining: set[str] = set()  # flipping decode workers whose requests move
        self.pending: dict[str, tuple] = {}  # address -> a balance asked: (count, reason, done, t)
        self.watch: set[str] = set()  # both: the cluster calls `between_steps` for them
        self.rounds: dict[int, _Round] = {}
        self.active: dict[str, int] = {}  # address -> its round in flight (one at a time)
        self.fetching: dict[int, tuple] = {}  # request index -> what its next worker queues
        self.awaiting: dict[str, dict[str, tuple[float, int]]] = {}  # first token not yet made
        self.flip_moved: Counter[str] = Counter()  # requests a flip in progress moved
        self.moves: Counter[str] = Counter()  # by reason
        self.bytes_put = 0
        self.bytes_fetched = 0
        self.recomputed = 0  # tokens the next workers computed again (the live worker's count)
        self._next = 0

    # ---- what starts a move ----------------------------------------------------------------
    def drain(self, w: SimWorker) -> bool:
        """A flip of `w` moves its requests (a decode worker, with a store to move them
        through); False: they finish in place."""
        if w.role != DECODE or self.c.store.capacity <= 0:
            return False
        self.draining.add(w.address)
        self.watch.add(w.address)
        return True

    def drained(self, address: str) -> int:
        """The flip of `address` ended (switched or failed): no new round; requests it moved."""
        self.draining.discard(address)
        self._unwatch(address)
        return self.flip_moved.pop(address, 0)

    def balance(self, address: str, count: int, reason: str, done) -> None:
        """Move `count` requests off a serving decode worker, keeping its role; `done(outcome)`
        once they were resumed elsewhere (at once, with the live worker's refusal, when it
        cannot)."""
        c, now = self.c, self.c.q.now
        w = c.workers.get(address)
        error = ("INVALID_ARGUMENT: count: must be >= 1" if count < 1 else
                 f"NOT_FOUND: no worker {address}" if w is None else
                 "FAILED_PRECONDITION: only a decode worker's running decodes move"
                 if w.role != DECODE else
                 "FAILED_PRECONDITION: worker is draining for a role switch"
                 if w.state != SERVING else
                 "FAILED_PRECONDITION: worker moves no decodes: no store"
                 if c.store.capacity <= 0 else "")
        if w is None or error or address in self.pending:
            done(MigrateOutcome(address, count, 0, 0.0, error or "a move is under way"))
            return
        self.pending[address] = (count, reason, done, now)
        self.watch.add(address)
        c._wake(w)  # a run is cut short: the round starts at the next step boundary

    def between_steps(self, w: SimWorker) -> None:
        """`w` is between two steps: a round starts (its pre-copy) when one is due."""
        a = w.address
        if a in self.active:
            return  # one round at a time; the next starts once it ended
        pending = self.pending.pop(a, None)
        if pending is not None:
            count, reason, done, started = pending
            self._start(w, most_left(w.engine.movable(), count), reason, count, done, started)
        elif a in self.draining:
            left = w.engine.movable()
            if left:
                self._start(w, list(left), DRAIN, len(left), None, self.c.q.now)
        self._unwatch(a)

    def _unwatch(self, address: str) -> None:
        if address not in self.draining and address not in self.pending:
            self.watch.discard(address)

    # ---- a round -----------------------------------------------------------------------------
    def _start(self, w: SimWorker, rids: list[str], reason: str, requested: int, done,
               started_s: float) -> None:
        n = self._next = self._next + 1
        rnd = self.rounds[n] = _Round(w.address, reason, requested, done, started_s)
        self.active[w.address] = n
        held = self.c.store.blocks
        missing: dict[bytes, None] = {}
        for rid in rids:
            full = w.engine.full_blocks(rid)
            rnd.copied[rid] = len(full)
            missing.update((h, None) for h in full if h not in held)
        rnd.last = list(missing)  # put when the copy lands
        self._put(w, (COPY, n, w.address), len(rnd.last))

    def _put(self, w: SimWorker, key: tuple, blocks: int) -> None:
        c = self.c
        w.inbound += 1  # the drain waits for the worker's own puts
        self.bytes_put += blocks * c.bpt
        c._send(c.links[w.address], key, blocks * c.bpt)

    def landed(self, kind: str, key: int, w: SimWorker) -> None:
        """A transfer of a move ended (`key`: a round's number, or a fetching request's index)."""
        if kind == COPY:
            rnd = self.rounds[key]
            self.c.store.put(rnd.last)
            self.c._join(w, lambda: self._stop(key))
        elif kind == PUT:
            self._resume_all(key)
        else:
            self._queue(key, w)

    def _stop(self, n: int) -> None:
        """Between two steps: the round's requests leave the engine; their last blocks follow."""
        rnd, c = self.rounds[n], self.c
        w = c.workers[rnd.address]
        held, waiting = c.store.blocks, self.awaiting.get(w.address, {})
        last: dict[bytes, None] = {}
        for rid, copied in rnd.copied.items():
            got = w.engine.stop(rid)
            if got is None:
                continue  # it finished meanwhile: nothing to move
            waiting.pop(rid, None)  # moved on before its first token here
            prompt, tokens, known, full = got
            rnd.moved.append((int(rid), prompt, tokens, known, full))
            last.update((h, None) for h in full[copied:] if h not in held)
        rnd.last = list(last)
        self._put(w, (PUT, n, w.address), len(rnd.last))

    def _resume_all(self, n: int) -> None:
        rnd, c = self.rounds.pop(n), self.c
        c.store.put(rnd.last)
        now = c.q.now
        for i, prompt, tokens, known, full in rnd.moved:
            self._resume(i, rnd.address, prompt, tokens, known, full, now)
        moved = len(rnd.moved)
        self.moves[rnd.reason] += moved
        if rnd.address in self.draining:
            self.flip_moved[rnd.address] += moved
        del self.active[rnd.address]
        if rnd.done is not None:
            rnd.done(MigrateOutcome(rnd.address, rnd.requested, moved, now - rnd.started_s))
        w = c.workers[rnd.address]
        if rnd.address in self.watch or w.state == DRAINING:
            c._wake(w)  # the next round, or the switch once drained

    def _resume(self, i: int, source: str, prompt, tokens, known, full: list[bytes],
                stop_s: float) -> None:
        """Request `i`'s stream ended on `source` with its blocks in the store: the router
        resumes it on another decode worker, which fetches what it lacks."""
        c, r = self.c, self.c.reqs[i]
        held = c.held.pop(i, None)
        if held is not None:
            c.router.release(*held)
        try:
            address, taken = c.router.pick(DECODE, r.prompt_tokens, r.output_tokens,
                                           exclude=frozenset((source,)))
        except NoWorkerError:  # the live route gives up with UNAVAILABLE
            c.router.admission.release("")
            c._prefilled(i, answered=False)
            c.offloaded.discard(i)
            c._resolved(i, "failed: no decode worker")
            return
        c.held[i] = (address, taken, 0)
        c.report.decode_worker[i] = address
        d = c.workers[address]
        here = d.engine.cached_blocks(full)
        rest = full[here:]
        stored = c.store.leading(rest) if rest else 0
        self.fetching[i] = (prompt, tokens, known, rest[:stored], stop_s)
        self.bytes_fetched += stored * c.bpt
        # The last, partial block where the store had the rest; from the first block missing
        # otherwise.
        self.recomputed += len(tokens) - (here + stored) * c.cfg.block_size
        d.inbound += 1
        c._send(c.links[address], (FETCH, i, address), stored * c.bpt)

    def _queue(self, i: int, w: SimWorker) -> None:
        """Request `i`'s blocks reached `w`: it joins at the next step boundary."""
        prompt, tokens, known, fetched, stop_s = self.fetching.pop(i)
        output_tokens = self.c.reqs[i].output_tokens

        def enter() -> None:
            w.engine.import_cached(fetched)
            w.engine.resume(str(i), prompt, tokens, known, output_tokens)
            if len(tokens) > len(prompt):  # it made tokens before: its stall is timed
                self.awaiting.setdefault(w.address, {})[str(i)] = (stop_s, len(tokens))

        self.c._join(w, enter)

    def stepped(self, w: SimWorker) -> None:
        """A step of `w` ended: the stall of each resumed request that made its first token."""
        waiting, now = self.awaiting[w.address], self.c.q.now
        seqs = w.engine.seqs
        for rid, (stop_s, n) in list(waiting.items()):
            seq = seqs.get(rid)
            if seq is None or len(seq.token_ids) > n:  # a token made (or its last: it ended)
                self.c.report.migration_stall_s.append(now - stop_s)
                del waiting[rid]
        if not waiting:
            del self.awaiting[w.address]

    def counts(self) -> dict:
        return {"migrations": {r: self.moves[r] for r in sorted(self.moves)},
                "migration_bytes": self.bytes_put, "migration_fetch_bytes": self.bytes_fetched,
                "migration_recomputed_tokens": self.recomputed}
