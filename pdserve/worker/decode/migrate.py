"""Running decodes handed to another decode worker with their KV (live migration), source side.

Owns moving a sequence off this worker without the next worker recomputing it:
1. pre-copy: its full blocks are read between two steps and put to the store while it keeps
   decoding;
2. stop: between two steps, the blocks completed since are read and the sequence is aborted
   (the sequences moved together stop between the same two steps);
3. those last blocks are put; only then does its stream end with `SequenceMoved`, which the
   decode relay answers with a `moved` message after every token made here.

The router resumes the request on another decode worker with every token the client got; that
worker finds the blocks in the store under the keys a prompt of those tokens has
(`DecodeRole.decode_local` fetches them) and computes only the last, partial block. A block the
store refuses is recomputed there from the first one missing: slower, never wrong. Sampling
moves with the request (seeded per output position; penalties read the tokens), so the
continuation is the one this worker would have made.
Counts moves by reason and outcome and the bytes put. `most_left` ranks the running ones for a
caller that moves some (the controller's balance: those with the most tokens left to generate
relieve this worker longest). Must not decide how many sequences move, or where to: the caller
and the router do.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass

# The shared names, re-exported for the worker's modules.
from pdserve.core.migration import (BALANCE, COPIED, DRAIN, PARTIAL,  # noqa: F401
                                    REASONS, SHUTDOWN, most_left)
from pdserve.worker.engine_loop import EngineLoop, StreamItem
from pdserve.worker.kv_blocks import put_missing, reusable_prefix

log = logging.getLogger(__name__)



class SequenceMoved(Exception):
    """Ends a moved request's stream on this worker: its blocks are in the store."""


@dataclass
class Moved:
    request_id: str
    tokens: int  # prompt and output tokens it had here
    blocks: int  # full blocks put (or already in the store)
    outcome: str


def _nbytes(block) -> int:
    n = getattr(block, "nbytes", None)
    return int(n) if n is not None else len(block)


class Migrator:
    def __init__(self, loop: EngineLoop, store, model_id: str) -> None:
        self.loop, self.store, self.model_id = loop, store, model_id
        self._lock = threading.Lock()
        self.moves: Counter[str] = Counter()  # "reason/outcome" -> sequences moved
        self.bytes_put = 0

    def movable(self) -> list[str]:
        """The requests this worker decodes now, each with a stream to end (prefilled ones
        included; one still prefilling moves as it is, with nothing to copy)."""
        def read() -> list[str]:
            return [rid for rid in self.loop.engine.seqs if self.loop.has_stream(rid)]
        return self.loop.call(read)

    def most_left(self, count: int) -> list[str]:
        """The `count` movable requests with the most tokens left to generate."""
        def read() -> dict[str, int]:
            return {rid: seq.max_tokens - seq.num_output_tokens
                    for rid, seq in self.loop.engine.seqs.items() if self.loop.has_stream(rid)}
        return most_left(self.loop.call(read), count)

    def move(self, request_ids: list[str], reason: str) -> list[Moved]:
        """Move these requests together (those that finished meanwhile are skipped): each one's
        blocks pre-copied while all decode on, then all stopped between the same two steps, so
        each waits for the others' last blocks only, not for their whole copies."""
        engine = self.loop.engine
        copied: dict[str, int] = {}
        ok: dict[str, bool] = {}
        for rid in request_ids:
            def snapshot(rid=rid):  # engine thread: the full blocks it has now, copied
                seq = engine.seqs.get(rid)
                if seq is None or not self.loop.has_stream(rid):
                    return None
                hashes, keys = reusable_prefix(engine, self.model_id, list(seq.token_ids),
                                               seq.salt)
                return keys, [b for _, b in engine.read_cached_blocks(hashes)]

            first = self.loop.call(snapshot)
            if first is not None:
                ok[rid] = self._put(*first)  # pre-copy, while it decodes on
                copied[rid] = len(first[1])

        def stop():  # engine thread: the blocks completed since, then each ends here
            out = []
            for rid, n in copied.items():
                seq = engine.seqs.get(rid)
                stream = None if seq is None else self.loop.take_stream(rid)
                if stream is None:
                    continue  # it finished or its client left meanwhile: nothing to move
                tokens = list(seq.token_ids)
                hashes, keys = reusable_prefix(engine, self.model_id, tokens, seq.salt)
                rest = engine.read_cached_blocks(hashes[n:])
                engine.abort(rid)
                out.append((rid, stream, len(tokens), keys[n:n + len(rest)],
                            [b for _, b in rest]))
            return out

        stopped = self.loop.call(stop)
        all_ok = self._put([k for s in stopped for k in s[3]], [b for s in stopped for b in s[4]])
        moved = []
        for rid, stream, n_tokens, _, blocks in stopped:
            outcome = COPIED if ok[rid] and all_ok else PARTIAL
            with self._lock:
                self.moves[f"{reason}/{outcome}"] += 1
            stream.q.put(StreamItem(error=SequenceMoved(f"moved ({reason})")))
            n_blocks = copied[rid] + len(blocks)
            log.info("moved %s (%s): %d tokens, %d blocks in the store (%s)", rid, reason,
                     n_tokens, n_blocks, outcome)
            moved.append(Moved(rid, n_tokens, n_blocks, outcome))
        return moved

    def _put(self, keys: list[str], blocks: list) -> bool:
        """Put what the store lacks; False if it refused (the target recomputes from there)."""
        if not keys:
            return True
        try:
            n = put_missing(self.store, keys, blocks)
        except Exception as e:  # StoreFailure, StagingError: the target recomputes instead
            log.warning("a moved sequence's blocks were not stored (%s); the next worker "
                        "recomputes them", e)
            return False
        with self._lock:
            self.bytes_put += n * _nbytes(blocks[0])  # blocks are all one size
        return True

    def stats(self) -> dict:
        """Moves by "reason/outcome" (every pair, from zero) and the bytes put for them."""
        with self._lock:
            moves = {f"{r}/{o}": self.moves[f"{r}/{o}"] for r in REASONS
                     for o in (COPIED, PARTIAL)}
            return {"migrations": moves, "migration_bytes": self.bytes_put}
