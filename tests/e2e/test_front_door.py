"""The router's door with real processes: discovery through reflection alone, cancellation that
frees KV, tenants that share no cached blocks, overload refused with RESOURCE_EXHAUSTED and a
retry hint (every accepted request still completes), and Prometheus metrics on router and workers.
"""

from __future__ import annotations

import threading
import time
import urllib.request

import grpc
import psutil
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from pdserve import rpc
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from tests.e2e.test_cluster import generate, worker_stats, workers
from tests.helpers import free_port


def _request(token_ids, **sampling) -> api_pb2.GenerateRequest:
    req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(**sampling))
    req.token_ids.ids.extend(token_ids)
    return req


def _prompt(cluster, text: str) -> list[int]:
    return Tokenizer.from_path(cluster.spec.model_path).encode(text)


def test_a_client_discovers_the_service_through_reflection_alone(tiny_cluster):
    with rpc.make_channel(tiny_cluster.router_address, rpc.PUBLIC) as ch:
        db = ProtoReflectionDescriptorDatabase(ch)
        assert "pdserve.v1.Generation" in db.get_services()
        pool = descriptor_pool.DescriptorPool(db)
        service = pool.FindServiceByName("pdserve.v1.Generation")
        method = service.methods_by_name["Generate"]
        req_cls = message_factory.GetMessageClass(method.input_type)
        resp_cls = message_factory.GetMessageClass(method.output_type)
        req = req_cls(prompt="Reflection tells me", sampling={"max_tokens": 8, "ignore_eos": True})
        call = ch.unary_stream("/pdserve.v1.Generation/Generate",
                               request_serializer=req_cls.SerializeToString,
                               response_deserializer=resp_cls.FromString)
        ids = [t for r in call(req, timeout=120) for t in r.token_ids]
    expected, *_ = generate(tiny_cluster.router_address, prompt="Reflection tells me",
                            max_tokens=8, ignore_eos=True)
    assert ids == expected and len(ids) == 8


def _idle(decode: str, timeout_s: float = 30.0) -> object:
    deadline = time.monotonic() + timeout_s
    while True:
        s = worker_stats(decode)
        if s.num_running == 0 and s.num_waiting == 0:
            return s
        assert time.monotonic() < deadline, f"decode worker still busy: {s}"
        time.sleep(0.1)


def test_cancelling_a_stream_stops_decoding_and_frees_its_kv(tiny_cluster):
    [decode] = workers(tiny_cluster, "decode")
    before = _idle(decode)
    prompt = _prompt(tiny_cluster, "A very long story begins " * 8)
    with rpc.make_channel(tiny_cluster.router_address, rpc.PUBLIC) as ch:
        call = api_pb2_grpc.GenerationStub(ch).Generate(
            _request(prompt, max_tokens=400, ignore_eos=True), timeout=300)
        got = 0
        for r in call:
            got += len(r.token_ids)
            if got >= 5:
                break
        running = worker_stats(decode)
        call.cancel()
    assert running.num_running == 1 and running.num_free_blocks < before.num_free_blocks
    after = _idle(decode)
    assert after.num_free_blocks == before.num_free_blocks  # its blocks back in the pool
    ids, *_ = generate(tiny_cluster.router_address, token_ids=prompt, max_tokens=4,
                       ignore_eos=True)
    assert len(ids) == 4  # and it goes on serving


@pytest.fixture(scope="module")
def keyed_router(tiny_cluster, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "api_keys"
    keys.write_text("sk-tenant-a-0001 alice\nsk-tenant-b-0002 bob\n")
    return tiny_cluster.add_router("router-keys", free_port(), "round_robin",
                                   {"api_keys_file": str(keys)})


def _cached(address: str, key: str | None, prompt: list[int], salt: str = "") -> int:
    meta = (("authorization", f"Bearer {key}"),) if key else None
    req = _request(prompt, max_tokens=2, ignore_eos=True)
    req.cache_salt = salt
    with rpc.make_channel(address, rpc.PUBLIC) as ch:
        last = list(api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120, metadata=meta))[-1]
    return last.usage.cached_prompt_tokens


def test_two_tenants_never_share_cached_blocks_one_tenant_does(keyed_router, tiny_cluster):
    prompt = _prompt(tiny_cluster, "Tenant isolation matters for shared caches. " * 6)
    assert len(prompt) >= 48
    assert _cached(keyed_router, "sk-tenant-a-0001", prompt) == 0
    assert _cached(keyed_router, "sk-tenant-a-0001", prompt) >= 32  # same tenant: hits
    assert _cached(keyed_router, "sk-tenant-b-0002", prompt) == 0  # other tenant: none
    assert _cached(keyed_router, "sk-tenant-b-0002", prompt) >= 32
    for bad in (None, "sk-unknown-key-9"):
        with pytest.raises(grpc.RpcError) as e:
            _cached(keyed_router, bad, prompt)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cache_salt_splits_the_cache_without_keys(tiny_cluster):
    prompt = _prompt(tiny_cluster, "Salted prompts do not meet unsalted ones. " * 6)
    addr = tiny_cluster.router_address
    assert _cached(addr, None, prompt) == 0
    assert _cached(addr, None, prompt, salt="s1") == 0
    assert _cached(addr, None, prompt, salt="s1") >= 32


def test_overload_gets_resource_exhausted_with_a_retry_hint_and_accepted_requests_finish(
        tiny_cluster):
    router = tiny_cluster.add_router("router-small", free_port(), "round_robin",
                                     {"max_in_flight": 2})
    [proc] = [psutil.Process(c.proc.pid) for c in tiny_cluster.children if c.address == router]
    generate(router, prompt="warm up", max_tokens=2)
    rss_before = proc.memory_info().rss
    prompt = _prompt(tiny_cluster, "Burst traffic arrives all at once. ")
    results: list[tuple[str, object]] = []
    lock = threading.Lock()

    def one() -> None:
        with rpc.make_channel(router, rpc.PUBLIC) as ch:
            call = api_pb2_grpc.GenerationStub(ch).Generate(
                _request(prompt, max_tokens=24, ignore_eos=True), timeout=300)
            try:
                out = list(call)
                outcome = ("ok", out[-1])
            except grpc.RpcError as e:
                hint = dict(e.trailing_metadata() or ()).get("retry-after")
                outcome = (e.code().name, (e.details(), hint))
        with lock:
            results.append(outcome)

    threads = []
    for _ in range(3):  # three bursts of 10x the bound: refusals must not pile up memory
        burst = [threading.Thread(target=one) for _ in range(20)]
        for t in burst:
            t.start()
        for t in burst:
            t.join(300)
        threads += burst
    rss_growth = proc.memory_info().rss - rss_before
    kinds = {k for k, _ in results}
    assert len(results) == 60 and kinds <= {"ok", "RESOURCE_EXHAUSTED"}, [r for r in results if r[0] not in ("ok", "RESOURCE_EXHAUSTED")]
    refused = [v for k, v in results if k == "RESOURCE_EXHAUSTED"]
    accepted = [v for k, v in results if k == "ok"]
    assert refused and accepted
    assert all("retry after" in d and float(h) > 0 for d, h in refused)
    assert all(r.finish_reason == common_pb2.FINISH_REASON_LENGTH
               and r.usage.completion_tokens == 24 for r in accepted)
    assert rss_growth < 64 << 20, f"router RSS grew {rss_growth >> 20} MiB over three bursts"
    ids, *_ = generate(router, token_ids=prompt, max_tokens=3, ignore_eos=True)
    assert len(ids) == 3  # still serving
    tiny_cluster.stop_child(router)


def _scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.status == 200
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def _metric(samples: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(prefix))


def test_prometheus_metrics_on_the_router_and_every_worker(tiny_cluster):
    # A prompt of several full blocks no earlier test sent: the prefill worker must put them.
    fresh = f"Metrics please, run {free_port()}: " + "count the blocks written. " * 10
    generate(tiny_cluster.router_address, prompt=fresh, max_tokens=6, ignore_eos=True)
    router = _scrape(f"http://{tiny_cluster.http_address}/metrics")
    assert _metric(router, "pdserve:time_to_first_token_seconds_count") >= 1
    assert _metric(router, "pdserve:inter_token_latency_seconds_count") >= 5
    assert _metric(router, "pdserve:e2e_request_latency_seconds_count") >= 1
    assert _metric(router, "pdserve:request_queue_time_seconds_count") >= 1
    assert _metric(router, "pdserve:generation_tokens_total") >= 6
    assert _metric(router, "pdserve:prefix_cache_queries_total") >= 2
    assert "pdserve:num_requests_running" in "".join(router)
    assert len(tiny_cluster.worker_metrics) == 2
    for address, url in tiny_cluster.worker_metrics.items():
        w = _scrape(url)
        assert 0.0 <= _metric(w, "pdserve:kv_cache_usage_perc") <= 1.0
        for name in ("pdserve:num_requests_running", "pdserve:num_requests_waiting",
                     "pdserve:prefix_cache_queries_total", "pdserve:prefix_cache_hits_total",
                     "pdserve:spec_decode_num_drafts_total"):
            assert any(k.startswith(name) for k in w), (address, name)
    [prefill] = workers(tiny_cluster, "prefill")
    assert _metric(_scrape(tiny_cluster.worker_metrics[prefill]), "pdserve:kv_blocks_put") >= 2


def test_the_request_id_is_on_log_lines_of_every_hop(tiny_cluster):
    rid = f"trace-me-{free_port()}"
    req = api_pb2.GenerateRequest(request_id=rid, prompt="Follow this request",
                                  sampling=common_pb2.SamplingParams(max_tokens=3))
    with rpc.make_channel(tiny_cluster.router_address, rpc.PUBLIC) as ch:
        assert all(r.request_id == rid
                   for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120))
    hops = {}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for c in tiny_cluster.children:
            if c.name in ("router", "prefill-0", "decode-1"):
                with open(c.log_path, errors="replace") as f:
                    hops[c.name] = f"[req={rid}~" in f.read()  # and the router's suffix
        if len(hops) == 3 and all(hops.values()):
            break
        time.sleep(0.2)
    assert hops == {"router": True, "prefill-0": True, "decode-1": True}


def test_a_request_id_sent_twice_at_once_serves_both(tiny_cluster):
    # Clients reuse ids (and two clients may pick the same one): each use is a request of its
    # own on the workers, and each stream carries the id its client sent.
    rid = f"reused-{free_port()}"
    req = api_pb2.GenerateRequest(request_id=rid, prompt="Twice at once",
                                  sampling=common_pb2.SamplingParams(max_tokens=12,
                                                                     ignore_eos=True))
    results: list = [None, None]

    def run(i: int) -> None:
        with rpc.make_channel(tiny_cluster.router_address, rpc.PUBLIC) as ch:
            try:
                results[i] = list(api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=120))
            except grpc.RpcError as e:
                results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out in results:
        assert isinstance(out, list), out.details()
        assert {m.request_id for m in out} == {rid}
        assert sum(len(m.token_ids) for m in out) == 12
    assert [t for m in results[0] for t in m.token_ids] == \
        [t for m in results[1] for t in m.token_ids]  # greedy: the same answer


@pytest.mark.parametrize("field,n,best_of", [("n", -1, 0), ("n", 17, 0), ("best_of", 1, -3),
                                             ("best_of", 3, 2)])
def test_a_choice_count_out_of_range_is_refused_naming_its_field(tiny_cluster, field, n,
                                                                 best_of):
    req = api_pb2.GenerateRequest(prompt="hi", n=n, best_of=best_of,
                                  sampling=common_pb2.SamplingParams(max_tokens=2))
    with rpc.make_channel(tiny_cluster.router_address, rpc.PUBLIC) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert e.value.details().startswith(f"{field}: "), e.value.details()
