"""Running decodes moved to another decode worker with their KV (live migration), with real
processes on loopback (tiny Llama, 1 prefill + 2 decode workers, a cluster of its own).

A decode worker flipped to prefill by the controller's flip (drain with migration) while twenty
streaming requests, greedy and seeded-sampled, decode on it and on the other decode worker:
- the flip moves every request running on it instead of finishing them in place;
- every request ends with exactly the tokens and text of a fault-free run;
- the other worker continued them from the blocks the first put to the store, computing only
  each one's last partial block, not its prompt and every token again;
- the router counts no failure or resume for them, and times the gap each client saw.

A decode worker stopped with SIGTERM (a scale-down, a rollout) moves its running requests the
same way before it exits: every one ends with the fault-free tokens. And where the store cannot
keep a moved request's blocks (a store far too small: they are evicted before the next worker
reads them), that worker recomputes them: slower, and still the fault-free tokens.
"""

from __future__ import annotations

import json
import signal
import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from pdserve.controller.flip import Flipper
from pdserve.core.roles import PREFILL
from pdserve.launcher.local import LocalCluster
from pdserve.proto import common_pb2
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats
from tests.e2e.test_membership import wait_for
from tests.e2e.test_migration import Stream, child, retries_metric

N = 20
MAX_TOKENS = 400
MOVE_AFTER_TOKENS = 12  # every stream has this many when the flip starts: mid-answer
BLOCK = 16  # the tiny model's block size (cluster_spec's default)
PROMPTS = [list(range(700 + 13 * i, 700 + 13 * i + 20 + 3 * i)) for i in range(N)]
SAMPLING = [dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0) if i % 2 == 0 else
            dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, top_p=0.9,
                 seed=9000 + i, presence_penalty=0.3) for i in range(N)]


def fresh(tiny_llama_dir, **overrides) -> LocalCluster:
    """A cluster whose workers have cached nothing of these requests (the baseline's cluster
    has: a move there could be served from the target's own cache)."""
    return LocalCluster(cluster_spec(tiny_llama_dir, prefill_workers=1, decode_workers=2,
                                     num_blocks=1024, router_settings={"stats_interval_s": 0.2},
                                     **overrides))


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    with fresh(tiny_llama_dir) as c:
        yield c


def metric(cluster, name: str) -> float:
    """A router metric's value (a histogram's `_count` or `_sum`), summed over its labels."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


HTTP = range(N - 2, N)  # these requests stream over the OpenAI HTTP API, the rest over gRPC


@pytest.fixture(scope="module")
def baseline(cluster):
    """(tokens, text) of every request, run concurrently without a move, each over its own API
    (an HTTP request left unset takes the model's recommended sampling: not the gRPC one's)."""
    def run(i: int):
        if i not in HTTP:
            return generate(cluster.router_address, token_ids=PROMPTS[i], **SAMPLING[i])[:2]
        s = HttpStream(cluster.http_address, i)
        s.run()
        assert s.error is None and s.finish == common_pb2.FINISH_REASON_LENGTH, s.error
        return None, s.text

    with ThreadPoolExecutor(N) as pool:
        return list(pool.map(run, range(N)))


class HttpStream(threading.Thread):
    """Request i streamed as an OpenAI completion over HTTP (the router relays it on the decode
    stream's reader thread); `ids` grow by one per token chunk, `text` is what it said."""

    def __init__(self, http: str, i: int) -> None:
        super().__init__(daemon=True)
        self.http, self.i = http, i
        self.ids: list[int] = []
        self.text = ""
        self.finish = None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"prompt": PROMPTS[self.i], "stream": True, **SAMPLING[self.i]}
        req = urllib.request.Request(f"http://{self.http}/v1/completions",
                                     json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                for line in r:
                    if not line.startswith(b"data: {"):
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    self.text += choice["text"]
                    self.ids.append(0)
                    if choice["finish_reason"]:
                        self.finish = common_pb2.FINISH_REASON_LENGTH
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def start_streams(cluster) -> tuple[list, dict[str, int]]:
    """N streams (`HTTP` ones over HTTP), once each has MOVE_AFTER_TOKENS tokens and both
    decode workers decode some; and how many each decode worker runs then."""
    decode = cluster.worker_addresses("decode")
    streams = [HttpStream(cluster.http_address, i) if i in HTTP else
               Stream(cluster.router_address, i, PROMPTS[i], SAMPLING[i]) for i in range(N)]
    for s in streams:
        s.start()

    return streams, streaming(streams, decode, lambda n: all(n.values()),
                              "both decode workers decoding")


def streaming(streams, decode: list[str], enough, what: str) -> dict[str, int]:
    """Once every stream has MOVE_AFTER_TOKENS tokens and the decode workers' running counts
    satisfy `enough`: those counts, by worker."""
    def running() -> dict[str, int] | None:
        if any(len(s.ids) < MOVE_AFTER_TOKENS for s in streams):
            return None
        n = {a: worker_stats(a).num_running for a in decode}
        return n if enough(n) else None

    return wait_for(f"every request streaming, {what}", running, 120)


def assert_fault_free(streams: list, baseline) -> None:
    for s in streams:
        s.join(timeout=240)
        assert not s.is_alive(), f"request {s.i} hangs"
        assert s.error is None, f"request {s.i}: {s.error}"
    for s, (ids, text) in zip(streams, baseline):
        if not isinstance(s, HttpStream):  # over HTTP: its text says it
            assert s.ids == ids, f"request {s.i}: tokens differ from the fault-free run"
        assert s.text == text, f"request {s.i}: text differs from the fault-free run"
        assert s.finish == common_pb2.FINISH_REASON_LENGTH


def test_a_flip_moves_every_running_decode_with_its_kv_and_changes_no_token(tiny_llama_dir,
                                                                            baseline):
    with fresh(tiny_llama_dir) as cluster:
        flip_moves_every_running_decode(cluster, baseline)


def flip_moves_every_running_decode(cluster, baseline) -> None:
    decode = cluster.worker_addresses("decode")
    resumes = retries_metric(cluster, "resume")
    stalls = metric(cluster, "pdserve:migration_stall_seconds_count")
    streams, counts = start_streams(cluster)
    source = max(counts, key=counts.get)
    [target] = [a for a in decode if a != source]
    before_src, before_dst = worker_stats(source), worker_stats(target)
    flipper = Flipper(move=lambda *a: None)  # the router follows the worker's role by polling
    try:
        out = flipper.flip(source, PREFILL, drain_timeout_s=60, reason="test")
    finally:
        flipper.close()
    assert out.ok, out.error
    assert_fault_free(streams, baseline)
    # Every request running on it moved (none was left to finish there), with its blocks.
    after_src, after_dst = worker_stats(source), worker_stats(target)
    moved = after_src.migrations["drain/copied"] - before_src.migrations["drain/copied"]
    assert moved == out.moved_requests == counts[source]
    assert after_src.requests_finished - before_src.requests_finished == moved
    assert after_src.migrations["drain/partial"] == before_src.migrations["drain/partial"]
    assert after_src.migration_bytes > before_src.migration_bytes
    # The target fetched each moved request's blocks and computed only its last partial block,
    # not its prompt and every token it had made (at least 12 + 20 each).
    computed = after_dst.resumed_tokens_computed - before_dst.resumed_tokens_computed
    assert 0 < computed <= moved * BLOCK, (computed, moved)
    assert after_dst.kv_blocks_fetched - before_dst.kv_blocks_fetched >= moved
    # Not failures: no resume counted; each client's gap across the move is timed.
    assert retries_metric(cluster, "resume") == resumes
    assert metric(cluster, "pdserve:migration_stall_seconds_count") - stalls == moved


@pytest.mark.scenario  # a cluster of its own, SIGTERM under load: with the long scenarios
def test_a_decode_worker_stopped_with_sigterm_moves_its_running_decodes(tiny_llama_dir,
                                                                        baseline):
    with fresh(tiny_llama_dir) as cluster:
        resumes = retries_metric(cluster, "resume")
        streams, counts = start_streams(cluster)
        source = max(counts, key=counts.get)
        proc = child(cluster, source).proc
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert_fault_free(streams, baseline)
        # Moved, not broken: no resume counted; every one it ran crossed with a timed gap.
        assert retries_metric(cluster, "resume") == resumes
        assert metric(cluster, "pdserve:migration_stall_seconds_count") == counts[source]


@pytest.mark.scenario  # a cluster of its own with a tiny store: with the long scenarios
def test_moved_blocks_the_store_lost_are_recomputed_and_change_no_token(tiny_llama_dir,
                                                                        baseline):
    # A store of 64 KiB: the moved requests' blocks evict each other (a store of 2 MiB kept
    # them all) before the next worker reads them.
    with fresh(tiny_llama_dir, store_capacity_bytes=64 << 10) as cluster:
        streams, counts = start_streams(cluster)
        source = max(counts, key=counts.get)
        [target] = [a for a in cluster.worker_addresses("decode") if a != source]
        before = worker_stats(target)
        flipper = Flipper(move=lambda *a: None)
        try:
            out = flipper.flip(source, PREFILL, drain_timeout_s=60, reason="test")
        finally:
            flipper.close()
        assert out.ok and out.moved_requests == counts[source], out
        assert_fault_free(streams, baseline)
        # The blocks were gone: the target recomputed more than each one's last block.
        computed = (worker_stats(target).resumed_tokens_computed
                    - before.resumed_tokens_computed)
        assert computed > out.moved_requests * BLOCK, (computed, out.moved_requests)
