"""Property test: random operation sequences keep the master core's invariants.

After every operation: extents tile each segment (no two live extents overlap), every allocated
extent has exactly one holder, used bytes equal the sum of extents, every committed object has
at least one replica. At the end: replaying the journal (from nothing, from a mid-run snapshot,
from the final snapshot) rebuilds exactly the live core's committed state.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.kvstore.master import MasterCore, MasterError, Record
from tests.kvstore.master.factories import PAGE, add_node, make_config

KEYS = [f"key{i}" for i in range(24)]
NODES = {"n0": (6, 6), "n1": (6, 0), "n2": (4, 4)}  # dram pages, ssd pages

key = st.sampled_from(KEYS)
node = st.sampled_from(sorted(NODES))
pick = st.integers(0, 20)  # an index (mod the count) into pending or committed keys
size = st.integers(1, 2 * PAGE)
put_op = st.tuples(st.just("put"), key, size, st.integers(1, 3))
op = st.one_of(
    put_op, put_op, put_op, put_op, put_op,
    st.tuples(st.just("put_start"), key, size, st.integers(1, 3)),
    st.tuples(st.just("commit"), pick),
    st.tuples(st.just("abort"), pick),
    st.tuples(st.just("get"), pick),
    st.tuples(st.just("remove"), pick),
    st.tuples(st.just("pin"), pick, st.floats(0.5, 20)),
    st.tuples(st.just("corrupt"), pick, node),
    st.tuples(st.just("prefix"), st.lists(key, max_size=4)),
    st.tuples(st.just("advance"), st.floats(0, 6), st.sets(node)),
    st.tuples(st.just("expire")),
    st.tuples(st.just("register"), node),
    st.tuples(st.just("evict")),
    st.tuples(st.just("reclaim")),
    st.tuples(st.just("demotion"), st.booleans(), pick),
    st.tuples(st.just("demotion"), st.just(True), pick),
    st.tuples(st.just("demotion"), st.just(True), pick),
    st.tuples(st.just("snapshot")),
)


def nth(keys, i: int) -> str:
    """The i-th (mod) of `keys` in sorted order, or a key nobody has."""
    keys = sorted(keys)
    return keys[i % len(keys)] if keys else "missing"


def roundtrip(data):
    return json.loads(json.dumps(data, allow_nan=False))


class Run:
    def __init__(self) -> None:
        self.config = make_config(eviction_sample=3, lease_s=5, put_timeout_s=30,
                                  node_timeout_s=10, high_watermark=0.8, low_watermark=0.6)
        self.core = MasterCore(self.config)
        self.now = 0.0
        for n, (dram, ssd) in NODES.items():
            add_node(self.core, n, dram, ssd)
        self.records: list[Record] = []
        self.demotions = []
        self.mid_snapshot = None  # (snapshot, how many records it covers)

    def step(self, o: tuple) -> None:
        c, kind, now = self.core, o[0], self.now
        try:
            if kind in ("put", "put_start"):
                c.put_start(o[1], o[2], 0, o[3], now)
                if kind == "put":
                    c.put_commit(o[1], now)
            elif kind == "commit":
                c.put_commit(nth(c._pending, o[1]), now)
            elif kind == "abort":
                c.put_abort(nth(c._pending, o[1]))
            elif kind == "get":
                c.get(nth(c._objects, o[1]), now)
            elif kind == "remove":
                c.remove(nth(c._objects, o[1]), now)
            elif kind == "pin":
                c.pin(nth(c._objects, o[1]), o[2], now)
            elif kind == "corrupt":
                c.report_corrupt(nth(c._objects, o[1]), o[2], now)
            elif kind == "prefix":
                n, where = c.longest_prefix(o[1], now)
                assert n == len(where) and all(where)
            elif kind == "advance":
                self.now += o[1]
                for n in o[2]:
                    c.heartbeat(n, self.now)
            elif kind == "expire":
                c.expire_nodes(now)
            elif kind == "register" and o[1] not in c._cluster.nodes:  # a dead node returns
                add_node(c, o[1], *NODES[o[1]], now_s=now)
            elif kind == "evict":
                c.evict(now)
            elif kind == "reclaim":
                c.reclaim_pending(now)
            elif kind == "demotion" and self.demotions:
                d = self.demotions.pop(o[2] % len(self.demotions))
                if o[1]:
                    c.demote_done(d.key, d.source.node_id, now)
                else:
                    c.demote_abort(d.key, d.source.node_id)
            elif kind == "snapshot":
                self.drain()
                self.mid_snapshot = (roundtrip(c.snapshot()), len(self.records))
        except MasterError:
            pass  # NotFound, NoSpace, AlreadyExists, ...: refused, state unchanged
        self.demotions += c.take_demotions()
        c.check_invariants()

    def drain(self) -> None:
        self.records += [Record.from_dict(roundtrip(r.to_dict())) for r in self.core.take_journal()]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op, min_size=20, max_size=80))
def test_random_operations_keep_invariants_and_replay_exactly(ops) -> None:
    run = Run()
    for o in ops:
        run.step(o)
    run.drain()
    live = run.core.committed_state()
    config = run.config
    rebuilt = [MasterCore.restore(config, None, run.records, now_s=run.now),
               MasterCore.restore(config, roundtrip(run.core.snapshot()), [], now_s=run.now)]
    if run.mid_snapshot is not None:
        snap, covered = run.mid_snapshot
        rebuilt.append(MasterCore.restore(config, snap, run.records[covered:], now_s=run.now))
        # A crash between snapshot and log trimming: the covered records come back too.
        rebuilt.append(MasterCore.restore(config, snap, run.records, now_s=run.now))
    for core in rebuilt:
        assert core.committed_state() == live
        core.check_invariants()
