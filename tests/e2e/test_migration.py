"""No request is lost when a worker dies mid-request (tiny Llama, 1 prefill + 2 decode workers,
real processes on loopback, a cluster of its own: these tests kill workers).

- A decode worker killed with SIGKILL while six streaming requests (greedy and seeded-sampled,
  some with a structured output and penalties) decode on both decode workers: every request ends with exactly the tokens and text of a
  fault-free run of the same requests, its streams resumed on the other decode worker; the
  router's metrics and request samples count the resumes.
- The only prefill worker killed with SIGKILL: requests sent at once (the router still lists
  it) and after it is GONE are prefilled by the decode worker itself, with the same tokens,
  and health stays SERVING.
"""

from __future__ import annotations

import threading
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc
from pdserve.launcher.local import LocalCluster
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import router_pb2 as rpb
from tests.e2e.conftest import cluster_spec
from tests.e2e.test_cluster import generate, worker_stats
from tests.e2e.test_membership import members, signals, wait_for

MAX_TOKENS = 300
KILL_AFTER_TOKENS = 10  # every unfinished stream has this many when the worker dies: mid-decode
POLL_S = 0.2  # the router's stats interval: a dead worker is GONE after 3 missed polls
PROMPTS = [list(range(500 + 11 * i, 500 + 11 * i + 10 + 4 * i)) for i in range(6)]
# Even requests greedy, odd ones sampled with a seed: both must continue exactly on resume.
SAMPLING = [dict(max_tokens=MAX_TOKENS, ignore_eos=True) if i % 2 == 0 else
            dict(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.9, top_p=0.95,
                 seed=4000 + i) for i in range(len(PROMPTS))]
# A structured output and the penalties follow a request to the worker it resumes on: its
# grammar's state and its token counts are replayed from the tokens it already sent.
SAMPLING[2].update(presence_penalty=0.5, structured_output=common_pb2.StructuredOutput(
    kind="regex", spec="[a-z][a-z ,.]*"))
SAMPLING[3].update(frequency_penalty=0.4, repetition_penalty=1.2, logit_bias={17: 3.0},
                   structured_output=common_pb2.StructuredOutput(kind="json_object"))


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    spec = cluster_spec(tiny_llama_dir, prefill_workers=1, decode_workers=2, num_blocks=512,
                        router_settings={"stats_interval_s": POLL_S})
    with LocalCluster(spec) as c:
        yield c


@pytest.fixture(scope="module")
def baseline(cluster):
    """(tokens, text) of every request, run concurrently on the fault-free cluster."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda i: generate(cluster.router_address, token_ids=PROMPTS[i],
                                                **SAMPLING[i]), range(len(PROMPTS))))
    for ids, _, finish, usage in outs:
        assert finish == common_pb2.FINISH_REASON_LENGTH and len(ids) == MAX_TOKENS
        assert usage.completion_tokens == MAX_TOKENS
    return [(ids, text) for ids, text, _, _ in outs]


class Stream(threading.Thread):
    """One streaming Generate on its own thread; `ids` grow as tokens arrive."""

    def __init__(self, router: str, i: int, prompt: list[int] | None = None,
                 sampling: dict | None = None) -> None:
        super().__init__(daemon=True)
        self.router, self.i = router, i
        self.prompt = PROMPTS[i] if prompt is None else prompt
        self.sampling = SAMPLING[i] if sampling is None else sampling
        self.ids: list[int] = []
        self.text = ""
        self.finish = None
        self.usage = None
        self.error: BaseException | None = None

    def run(self) -> None:
        req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**self.sampling))
        req.token_ids.ids.extend(self.prompt)
        try:
            with rpc.make_channel(self.router, rpc.PUBLIC) as ch:
                for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=300):
                    self.ids.extend(r.token_ids)
                    self.text += r.text
                    if r.finish_reason:
                        self.finish, self.usage = r.finish_reason, r.usage
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e


def retries_metric(cluster, hop: str) -> float:
    """The router's pdserve:request_retries_total for `hop`, summed over status codes."""
    with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=30) as r:
        text = r.read().decode()
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith("pdserve:request_retries_total{") and f'hop="{hop}"' in line)


def child(cluster, address: str):
    [c] = [c for c in cluster.children if c.address == address]
    return c


def test_decode_worker_killed_mid_stream_loses_no_request_and_changes_no_token(cluster,
                                                                               baseline):
    decode = cluster.worker_addresses("decode")
    resumes = retries_metric(cluster, "resume")
    before = signals(cluster.router_control_address)
    streams = [Stream(cluster.router_address, i) for i in range(len(PROMPTS))]
    for s in streams:
        s.start()

    def running() -> dict[str, int] | None:
        """Each decode worker's running requests, once every stream is decoding (or done) and
        both workers still decode some. The streams start unevenly (one prefill worker admits
        them in turn), so the first may finish before the last starts: the wait needs both
        workers busy, not every stream unfinished."""
        seen["tokens"] = [len(s.ids) for s in streams]
        if any(KILL_AFTER_TOKENS > len(s.ids) for s in streams):
            return None
        n = seen["running"] = {a: worker_stats(a).num_running for a in decode}
        return n if all(n.values()) else None

    seen: dict = {}
    try:
        counts = wait_for("every request streaming, both decode workers decoding", running, 120)
    except AssertionError as e:
        raise AssertionError(f"{e} (last seen: {seen})") from None
    victim = max(counts, key=counts.get)
    proc = child(cluster, victim).proc
    proc.kill()
    proc.wait()
    for s in streams:
        s.join(timeout=240)
        assert not s.is_alive(), f"request {s.i} hangs"
        assert s.error is None, f"request {s.i}: {s.error}"
    for s, (ids, text) in zip(streams, baseline):
        assert s.ids == ids, f"request {s.i}: tokens differ from the fault-free run"
        assert s.text == text, f"request {s.i}: text differs from the fault-free run"
        assert s.finish == common_pb2.FINISH_REASON_LENGTH
        assert s.usage.completion_tokens == MAX_TOKENS
        assert s.usage.prompt_tokens == len(PROMPTS[s.i])
    # Every request the victim was decoding was resumed, once, and counted so.
    resumed = retries_metric(cluster, "resume") - resumes
    assert resumed == counts[victim] >= 1
    after = signals(cluster.router_control_address)
    new = after.samples[len(after.samples) - len(PROMPTS):]
    assert all(x.finish == "length" and x.output_tokens == MAX_TOKENS for x in new)
    assert sum(x.retries for x in new) >= resumed
    assert after.retries_total - before.retries_total >= resumed
    # The router notices the dead worker by itself and stops listing it as ACTIVE.
    wait_for("the killed decode worker GONE", lambda: members(
        cluster.router_control_address)[victim].state == rpb.MEMBER_STATE_GONE)


def test_prefill_worker_killed_requests_are_prefilled_on_a_decode_worker(cluster, baseline):
    [prefill] = cluster.worker_addresses("prefill")
    fallbacks = retries_metric(cluster, "prefill_fallback")
    proc = child(cluster, prefill).proc
    proc.kill()
    proc.wait()
    # At once: the router still lists the dead worker, each prefill attempt is refused and the
    # request falls back once they are used up.
    with ThreadPoolExecutor(3) as pool:
        early = list(pool.map(lambda i: generate(cluster.router_address, token_ids=PROMPTS[i],
                                                 **SAMPLING[i]), range(3)))
    assert [(ids, text) for ids, text, _, _ in early] == baseline[:3]
    assert all(finish == common_pb2.FINISH_REASON_LENGTH for _, _, finish, _ in early)
    # Once it is GONE the prefill pool is empty: a decode worker still serves every request,
    # so health says SERVING.
    wait_for("the killed prefill worker GONE", lambda: members(
        cluster.router_control_address)[prefill].state == rpb.MEMBER_STATE_GONE)
    with rpc.make_channel(cluster.router_address, rpc.PUBLIC) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                       timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    with ThreadPoolExecutor(3) as pool:
        late = list(pool.map(lambda i: generate(cluster.router_address, token_ids=PROMPTS[i],
                                                **SAMPLING[i]), range(3, 6)))
    assert [(ids, text) for ids, text, _, _ in late] == baseline[3:]
    assert retries_metric(cluster, "prefill_fallback") - fallbacks == 6
    s = signals(cluster.router_control_address)
    assert all(x.retries >= 1 and x.finish == "length" for x in s.samples[-6:])
