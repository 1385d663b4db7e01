"""Prefix-cache hit rate of the store master on a real trace: `MasterCore` replayed, no processes.

Trace: `mooncake_conversation_trace.jsonl` from the Mooncake (FAST '25) release traces,
conversation workload, Apache-2.0; 12,031 requests over about one hour; fields `timestamp` (ms
from start), `input_length`, `output_length`, `hash_ids` (one id per 512-token prefix block; equal
ids = shared prefix). Read in place from `../shared/traces/` (not copied, numbers not rewritten).

Owns the replay: requests in timestamp order through one `MasterCore` with one fake node whose
DRAM segment holds `capacity_blocks` objects. Per request, `longest_prefix(keys)` gives the hit
blocks, the worker's read of them follows (`get`, which refreshes their LRU time as a real read
does), and every missing block is put (`put_start` + `put_commit`), the core evicting by its
watermarks (high 0.90, low 0.85 of capacity) with its approximate LRU. Also the two references in
the same run: the ideal (an unbounded cache: every id seen before hits) and an exact LRU cache of
the same capacity in blocks. Every trace block is one object of `object_bytes` = scale x the full
block bytes; the scale changes byte counts only (all objects are the same size, so the capacity
in blocks and the hit rates do not depend on it). Must not start processes or read clocks into
the core (the trace's timestamps are its clock).
"""

from __future__ import annotations

import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.kvstore.master.config import MasterConfig
from pdserve.kvstore.master.core import MasterCore
from pdserve.kvstore.master.model import AlreadyExists, NoSpace

BLOCK_TOKENS = 512
# The KV bytes of one token of Llama-3-8B in fp16: K and V x 32 layers x 8 KV heads x 128 dims x
# 2 bytes = 128 KiB; one 512-token block is then 64 MiB before scaling.
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2
FULL_BLOCK_BYTES = BLOCK_TOKENS * KV_BYTES_PER_TOKEN
DEFAULT_TRACE = os.path.join("..", "shared", "traces", "mooncake_conversation_trace.jsonl")


class TraceError(ValueError):
    """The trace file is missing or a record is malformed; the message says where."""


def default_trace_path() -> str:
    """`../shared/traces/...` relative to the repository root (the folder above `pdserve/`)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.normpath(os.path.join(root, DEFAULT_TRACE))


@dataclass(frozen=True)
class TraceRecord:
    timestamp_s: float  # the record's `timestamp` (ms from the trace's start) in seconds
    input_length: int  # prompt tokens, unscaled
    hash_ids: tuple[int, ...]  # one id per 512-token prefix block


def read_records(path: str, limit: int | None = None) -> list[TraceRecord]:
    """The trace's records in timestamp order (stable), at most `limit` (the earliest); every
    benchmark that replays a trace reads it here. TraceError names the file and line."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e}") from None
    out = []
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ids = rec["hash_ids"]
                if not isinstance(ids, list):
                    raise TypeError("hash_ids is not a list")
                out.append(TraceRecord(float(rec["timestamp"]) / 1000.0,
                                       int(rec["input_length"]),
                                       tuple(int(h) for h in ids)))
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(f"{path}:{lineno}: not a trace record ({e})") from None
    if not out:
        raise TraceError(f"trace {path} has no records")
    out.sort(key=lambda r: r.timestamp_s)
    return out[:limit] if limit is not None else out


def load_trace(path: str, limit: int | None = None) -> list[tuple[float, list[str]]]:
    """(timestamp in seconds, block keys) per request, in timestamp order (stable), at most
    `limit` of them (the earliest)."""
    return [(r.timestamp_s, [str(h) for h in r.hash_ids]) for r in read_records(path, limit)]


def ideal_hits(requests: Sequence[tuple[float, list[str]]]) -> tuple[int, int]:
    """(hit blocks, total blocks) of an unbounded cache: the leading blocks already seen."""
    seen: set[str] = set()
    hits = total = 0
    for _, keys in requests:
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        hits += n
        total += len(keys)
        seen.update(keys)
    return hits, total


def lru_hits(requests: Sequence[tuple[float, list[str]]], capacity_blocks: int) -> int:
    """Hit blocks of an exact LRU cache of `capacity_blocks` (a request touches all its blocks)."""
    lru: OrderedDict[str, None] = OrderedDict()
    hits = 0
    for _, keys in requests:
        n = 0
        while n < len(keys) and keys[n] in lru:
            n += 1
        hits += n
        for k in keys:
            lru[k] = None
            lru.move_to_end(k)
        while len(lru) > capacity_blocks:
            lru.popitem(last=False)
    return hits


def replay(requests: Sequence[tuple[float, list[str]]], capacity_blocks: int, object_bytes: int,
           config: MasterConfig | None = None,
           on_request: Callable[[], None] | None = None) -> dict:
    """Hit blocks of `MasterCore` at one capacity, and what its puts met on the way."""
    config = config or MasterConfig()
    align = config.alloc_align_bytes
    slot = -(-object_bytes // align) * align  # the allocator's length of one object
    core = MasterCore(config)
    start = requests[0][0] if requests else 0.0
    core.register_node("trace-node", "trace-host", "127.0.0.1:1",
                       [("trace-seg", capacity_blocks * slot, "dram", "")], start)
    hits = total = puts = already = nospace = 0
    t0 = time.perf_counter()
    for i, (now_s, keys) in enumerate(requests):
        n, _ = core.longest_prefix(keys, now_s)
        for key in keys[:n]:
            core.get(key, now_s)  # the prefill worker reads the cached prefix
        hits += n
        total += len(keys)
        for key in keys[n:]:
            try:
                core.put_start(key, object_bytes, 0, 1, now_s)
            except AlreadyExists:  # stored, but behind an evicted block: unreachable
                already += 1
                continue
            except NoSpace:  # everything left is leased: this block is not cached
                nospace += 1
                continue
            core.put_commit(key, now_s)
            puts += 1
        if i % 256 == 0:
            core.take_journal()  # nobody persists it here; keep memory flat
        if on_request is not None:
            on_request()
    stats = core.stats()["dram"]
    return {"capacity_blocks": capacity_blocks, "capacity_bytes": capacity_blocks * slot,
            "hit_blocks": hits, "total_blocks": total, "puts": puts,
            "put_already_stored": already, "put_no_space": nospace,
            "evictions": stats.evictions, "objects_at_end": stats.objects,
            "replay_s": time.perf_counter() - t0}


def replay_with_lru(requests: Sequence[tuple[float, list[str]]], capacity_blocks: int,
                    object_bytes: int, on_request: Callable[[], None] | None = None) -> dict:
    """`replay` at one capacity, with the exact LRU's hit blocks beside it (`lru_hit_blocks`);
    a top-level function, so that a process pool can run one capacity each."""
    row = replay(requests, capacity_blocks, object_bytes, on_request=on_request)
    row["lru_hit_blocks"] = lru_hits(requests, capacity_blocks)
    return row
