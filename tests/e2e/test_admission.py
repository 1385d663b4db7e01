"""The router's door, health and shutdown with real processes (tiny Llama cluster, loopback).

- About 10x overload over gRPC and HTTP at once, and 1,280 HTTP streams against the default
  bounds (past the connection bound too): every refusal is the router's own
  (RESOURCE_EXHAUSTED with a `retry-after` trailer, HTTP 429 with `Retry-After` and an OpenAI
  error body), each one counted in `pdserve:requests_rejected_total`; every accepted request
  completes with the idle cluster's tokens; the router's RSS stays bounded.
- The predicted-TTFT bound refuses the same way once the prefill rate is measured.
- Health: every decode worker stopped -> gRPC NOT_SERVING and `/health` 503 naming why,
  requests UNAVAILABLE / 503 with a retry hint; the worker back -> SERVING. A store the router
  cannot reach does not touch its health; a decode worker alone serves (prefilling itself).
- SIGTERM with streams in flight: new requests refused at once (UNAVAILABLE / 503), health
  NOT_SERVING, every stream completes with its tokens, exit 0 within the grace; past the grace,
  streams end with UNAVAILABLE "router shutting down".
"""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve import rpc
from pdserve.core.identity import ROUTER
from pdserve.engine.tokenizer import Tokenizer
from pdserve.proto import api_pb2, api_pb2_grpc, common_pb2
from pdserve.proto import router_pb2 as rpb
from pdserve.proto import router_pb2_grpc as rpb_grpc
from tests.e2e.test_cluster import workers
from tests.helpers import free_port, process_output, start_process, stop_process

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class Router:
    proc: object
    address: str
    http: str
    control: str  # its control listener (RouterControl; a free port: its ready line says)


def start_router(cluster, *args: str, prefill=None, decode=None) -> Router:
    """A router process over the cluster's workers (or those given), gRPC and HTTP."""
    address = f"127.0.0.1:{free_port()}"
    prefill = workers(cluster, "prefill") if prefill is None else prefill
    decode = workers(cluster, "decode") if decode is None else decode
    proc = start_process([sys.executable, "-m", "pdserve.router", "--model",
                          cluster.spec.model_path, "--address", address, "--prefill",
                          ",".join(prefill), "--decode", ",".join(decode), "--routing",
                          "round_robin", "--stats-interval-s", "0.2", "--http-port", "0", *args],
                         address, timeout_s=120)
    deadline = time.monotonic() + 30
    while not (m := re.search(r" ready on \S+ .*\bhttp=(\S+).*\bcontrol=(\S+)",
                              process_output(proc)[0])):
        assert proc.poll() is None and time.monotonic() < deadline, process_output(proc)
        time.sleep(0.05)
    return Router(proc, address, m.group(1), m.group(2))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmRSS:\s+(\d+) kB", f.read(), re.M).group(1)) * 1024


def rejected(router: Router, reason: str) -> float:
    text = httpx.get(f"http://{router.http}/metrics", timeout=30).text
    m = re.search(rf'^pdserve:requests_rejected_total{{[^}}]*reason="{reason}"[^}}]*}} (\S+)$',
                  text, re.M)
    return float(m.group(1)) if m else 0.0


def grpc_call(address: str, prompt: list[int], max_tokens: int) -> tuple[str, object]:
    """("ok", (ids, text)) or (status name, (details, retry-after trailer))."""
    req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))
    req.token_ids.ids.extend(prompt)
    ids, text = [], ""
    with rpc.make_channel(address, rpc.PUBLIC) as ch:
        try:
            for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=300):
                ids += r.token_ids
                text += r.text
        except grpc.RpcError as e:
            return e.code().name, (e.details(), dict(e.trailing_metadata() or ()).get(
                "retry-after"))
    return "ok", (ids, text)


def http_call(router: Router, prompt: list[int], max_tokens: int) -> tuple[int, object]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"http://{router.http}/v1/completions", json=body, timeout=300)
    if r.status_code == 200:
        return 200, r.json()["choices"][0]["text"]
    return r.status_code, (r.headers.get("retry-after"), r.json())


def burst(n: int, fn) -> list:
    """`fn(i)` on n threads at once; their results."""
    out: list = [None] * n
    start = threading.Barrier(n)

    def one(i: int) -> None:
        start.wait()
        out[i] = fn(i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert all(r is not None for r in out), "a client did not finish"
    return out


def check_refusals(results: list) -> tuple[list, list[str]]:
    """Split a mixed burst into (accepted, refusals' messages); every refusal is admission's,
    with a retry hint."""
    accepted, refused = [], []
    for kind, value in results:
        if kind in ("ok", 200):
            accepted.append((kind, value))
        elif kind == "RESOURCE_EXHAUSTED":
            details, hint = value
            assert "retry after" in details and hint is not None and float(hint) > 0, value
            refused.append(details)
        elif kind == 429:
            hint, body = value
            assert hint is not None and int(hint) >= 1, value
            assert body["error"]["type"] == "rate_limit_error" and "retry after" in \
                body["error"]["message"], body
            refused.append(body["error"]["message"])
        else:
            raise AssertionError(f"a refusal that is not admission's: {kind} {value}")
    return accepted, refused


def prompt_ids(cluster, text: str) -> list[int]:
    return Tokenizer.from_path(cluster.spec.model_path).encode(text)


def test_ten_times_overload_is_refused_by_admission_alone(tiny_cluster):
    router = start_router(tiny_cluster, "--max-in-flight", "4", "--max-predicted-ttft-s", "0")
    try:
        prompt = prompt_ids(tiny_cluster, "Ten times more clients than the router admits. ")
        kind, (ids, text) = grpc_call(router.address, prompt, 16)
        assert kind == "ok" and len(ids) == 16
        assert http_call(router, prompt, 16) == (200, text)  # warm, and the same greedy text
        rss_before = rss_bytes(router.proc.pid)
        refused_total = 0
        for _ in range(3):  # 20 gRPC + 20 HTTP clients at once against a bound of 4
            results = burst(40, lambda i: grpc_call(router.address, prompt, 16) if i % 2
                            else http_call(router, prompt, 16))
            accepted, refused = check_refusals(results)
            assert accepted and refused
            assert all(v == (ids, text) if k == "ok" else v == text for k, v in accepted)
            refused_total += len(refused)
        growth = rss_bytes(router.proc.pid) - rss_before
        assert growth < 96 << 20, f"router RSS grew {growth >> 20} MiB over three bursts"
        # Each refusal was the router's own admission: counted once, by reason.
        assert rejected(router, "in_flight") == refused_total
        assert grpc_call(router.address, prompt, 16) == ("ok", (ids, text))  # still serving
    finally:
        assert stop_process(router.proc, timeout_s=60) == 0


def test_ten_times_the_default_bound_in_http_streams_gets_answers_and_429s_only(tiny_cluster):
    import asyncio
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < 4096:  # this client holds 1,280 sockets
        resource.setrlimit(resource.RLIMIT_NOFILE, (
            4096 if hard == resource.RLIM_INFINITY else min(4096, hard), hard))

    # The defaults: 128 requests in flight, 1,024 connections; 1,280 streamed chats at once.
    router = start_router(tiny_cluster, "--max-predicted-ttft-s", "0")
    n = 1280
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}],
            "max_tokens": 4, "temperature": 0, "stream": True}
    try:
        body["model"] = httpx.get(f"http://{router.http}/v1/models",
                                  timeout=30).json()["data"][0]["id"]
        rss_before = rss_bytes(router.proc.pid)

        async def one(client: httpx.AsyncClient) -> tuple[int, object]:
            async with client.stream("POST", f"http://{router.http}/v1/chat/completions",
                                     json=body) as r:
                if r.status_code != 200:
                    return r.status_code, (r.headers.get("retry-after"),
                                           json.loads(await r.aread()))
                lines = [x async for x in r.aiter_lines() if x.startswith("data: ")]
                return 200, lines

        async def everyone() -> list:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
            async with httpx.AsyncClient(limits=limits, timeout=300) as client:
                return await asyncio.gather(*(one(client) for _ in range(n)))

        results = asyncio.run(everyone())
        codes = [code for code, _ in results]
        assert set(codes) <= {200, 429}, sorted(set(codes))
        assert 0 < codes.count(200) and 0 < codes.count(429)
        for code, value in results:
            if code == 200:  # a whole stream: its chunks, then [DONE]
                assert value[-1] == "data: [DONE]" and len(value) >= 2
            else:
                hint, err = value
                assert hint is not None and int(hint) >= 1, value
                assert err["error"]["type"] == "rate_limit_error" and "retry after" in \
                    err["error"]["message"], err
        # Every refusal counted by its reason: admission's, or the connection bound's.
        assert rejected(router, "in_flight") + rejected(router, "connections") == \
            codes.count(429)
        growth = rss_bytes(router.proc.pid) - rss_before
        assert growth < 160 << 20, f"router RSS grew {growth >> 20} MiB"
        assert httpx.post(f"http://{router.http}/v1/chat/completions",
                          json={**body, "stream": False}, timeout=60).status_code == 200
    finally:
        assert stop_process(router.proc, timeout_s=60) == 0


def test_a_connection_past_the_http_bound_gets_a_429_with_a_retry_hint(tiny_cluster):
    import socket

    router = start_router(tiny_cluster, "--max-in-flight", "4", "--http-max-connections", "8")
    host, port = router.http.rsplit(":", 1)
    idle: list[socket.socket] = []
    url = f"http://{router.http}/v1/models"
    try:
        assert httpx.get(url, timeout=30).status_code == 200
        for _ in range(8):  # eight connections held open, asking nothing
            idle.append(socket.create_connection((host, int(port)), timeout=30))
        deadline = time.monotonic() + 30
        while (r := httpx.get(url, timeout=30)).status_code == 200:  # until they are accepted
            assert time.monotonic() < deadline, "the idle connections were never counted"
            time.sleep(0.05)
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        assert r.json()["error"] == {
            "message": "too many connections: this router serves 8 at once; retry after 1s",
            "type": "rate_limit_error", "param": None, "code": "rate_limit_exceeded"}
        for sock in idle:  # freed: served again, the refusal counted
            sock.close()
        idle.clear()
        deadline = time.monotonic() + 30
        while httpx.get(url, timeout=30).status_code != 200:
            assert time.monotonic() < deadline, "closed connections were never freed"
            time.sleep(0.05)
        assert rejected(router, "connections") >= 1
    finally:
        for sock in idle:
            sock.close()
        assert stop_process(router.proc, timeout_s=60) == 0


def test_predicted_ttft_over_the_bound_is_refused_with_a_drain_time_hint(tiny_cluster):
    # 1 ms: even the tiny model's fastest measured prefill rate cannot clear two 400-token
    # prompts that fast, so every request that finds another queued is refused, on any host.
    router = start_router(tiny_cluster, "--max-in-flight", "64", "--max-predicted-ttft-s",
                          "0.001")
    try:
        # Distinct long prompts until the prefill worker's rate is measured.
        deadline = time.monotonic() + 120
        n = 0
        while httpx.get(f"http://{router.http}/health", timeout=30).json()[
                "prefill_tokens_per_s"] is None:
            assert time.monotonic() < deadline, "no prefill rate measured"
            assert grpc_call(router.address, [500 + n + 3 * i for i in range(400)], 1)[0] == "ok"
            n += 1
            time.sleep(0.1)
        prompt = [900 + 7 * i for i in range(400)]
        kind, expected = grpc_call(router.address, prompt, 4)
        assert kind == "ok"
        results = burst(30, lambda i: grpc_call(router.address, prompt, 4) if i % 2
                        else http_call(router, prompt, 4))
        accepted, refused = check_refusals(results)
        assert accepted and refused
        assert all(v == expected if k == "ok" else v == expected[1] for k, v in accepted)
        assert rejected(router, "predicted_ttft") == len(refused)
        assert rejected(router, "in_flight") == 0
        assert all("predicted time to first token" in message for message in refused)
        # Each admitted request's first token is set against its prediction, for operators to
        # see how far admission's promise is from what happens.
        text = httpx.get(f"http://{router.http}/metrics", timeout=30).text
        count = re.search(r"^pdserve:ttft_over_predicted_count\{[^}]*\} (\S+)$", text, re.M)
        assert count is not None and float(count.group(1)) >= len(accepted), text[-2000:]
        body = httpx.get(f"http://{router.http}/health", timeout=30).json()
        assert body["queued_prefill_tokens"] == 0 and body["in_flight"] == 0
    finally:
        assert stop_process(router.proc, timeout_s=60) == 0


def health_status(address: str, service: str = "", peer: str = rpc.PUBLIC) -> int:
    with rpc.make_channel(address, peer) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10).status


def wait_for(what: str, cond, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def start_worker(cluster, address: str, role: str = "decode"):
    """A worker on the cluster's store for a router of the test's own: it stays out of the
    cluster's membership, so the cluster's router sends it nothing."""
    return start_process([sys.executable, "-m", "pdserve.worker", "--role", role, "--model",
                          cluster.spec.model_path, "--address", address, "--store-address",
                          cluster.store_address, "--join-cluster", "false", "--num-blocks",
                          "256", "--block-size-tokens", "16", "--threads", "1"], address,
                         timeout_s=180)


def test_health_says_not_serving_exactly_while_no_decode_worker_serves(tiny_cluster):
    decode = f"127.0.0.1:{free_port()}"
    worker = start_worker(tiny_cluster, decode)
    # KV-aware with a store nobody listens on: the router needs no store to be healthy.
    router = start_router(tiny_cluster, "--routing", "kv_aware", "--store-address",
                          f"127.0.0.1:{free_port()}", decode=[decode])
    [prefill] = workers(tiny_cluster, "prefill")
    prompt = prompt_ids(tiny_cluster, "Is anybody serving? ")
    try:
        assert health_status(router.address) == SERVING
        r = httpx.get(f"http://{router.http}/health", timeout=30)
        assert r.status_code == 200 and r.json()["status"] == "ok"
        assert r.json()["active_workers"] == {"prefill": 1, "decode": 1}
        kind, expected = grpc_call(router.address, prompt, 8)
        assert kind == "ok"

        # No prefill worker: the decode worker prefills itself, so the router still serves.
        ctl = rpb_grpc.RouterControlStub(rpc.make_channel(router.control, ROUTER))
        ctl.SetWorkerState(rpb.SetWorkerStateRequest(address=prefill,
                                                     state=rpb.MEMBER_STATE_DRAINING), timeout=10)
        assert health_status(router.address) == SERVING
        assert httpx.get(f"http://{router.http}/health", timeout=30).json()[
            "active_workers"] == {"prefill": 0, "decode": 1}
        assert grpc_call(router.address, prompt, 8) == ("ok", expected)
        ctl.SetWorkerState(rpb.SetWorkerStateRequest(address=prefill,
                                                     state=rpb.MEMBER_STATE_ACTIVE), timeout=10)

        stop_process(worker, timeout_s=30)  # every decode worker gone
        for service in ("", "pdserve.v1.Generation"):
            wait_for(f"{service!r} NOT_SERVING",
                     lambda: health_status(router.address, service) == NOT_SERVING)
        # The control API (its own listener) stays up for the controller and operators.
        assert health_status(router.control, "pdserve.v1.RouterControl", ROUTER) == SERVING
        r = httpx.get(f"http://{router.http}/health", timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        body = r.json()
        assert body["status"] == "not_serving" and body["active_workers"]["decode"] == 0
        assert body["reason"].startswith("no decode worker is active") and decode in body["reason"]
        kind, (details, hint) = grpc_call(router.address, prompt, 8)
        assert kind == "UNAVAILABLE" and float(hint) > 0 and "retry after" in details
        assert details.startswith("no decode worker is active") and decode not in details
        status, (hint, err) = http_call(router, prompt, 8)
        assert status == 503 and int(hint) >= 1 and err["error"]["code"] == "service_unavailable"

        worker = start_worker(tiny_cluster, decode)  # back at the same address
        wait_for("SERVING again", lambda: health_status(router.address) == SERVING)
        assert health_status(router.address, "pdserve.v1.Generation") == SERVING
        assert httpx.get(f"http://{router.http}/health", timeout=30).status_code == 200
        assert grpc_call(router.address, prompt, 8) == ("ok", expected)
    finally:
        assert stop_process(router.proc, timeout_s=60) == 0
        stop_process(worker, timeout_s=30)


def sse_call(router: Router, prompt: list[int], max_tokens: int, started: threading.Event):
    """A streamed completion: ("ok", text) or ("error", the error event's body)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = ""
    with httpx.stream("POST", f"http://{router.http}/v1/completions", json=body,
                      timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "error", event["error"]
            text += event["choices"][0]["text"]
            if text:
                started.set()
    return "ok", text


def grpc_stream(address: str, prompt: list[int], max_tokens: int, started: threading.Event):
    req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))
    req.token_ids.ids.extend(prompt)
    ids = []
    with rpc.make_channel(address, rpc.PUBLIC) as ch:
        try:
            for r in api_pb2_grpc.GenerationStub(ch).Generate(req, timeout=300):
                ids += r.token_ids
                started.set()
        except grpc.RpcError as e:
            return e.code().name, (e.details(), dict(e.trailing_metadata() or ()).get(
                "retry-after"))
    return "ok", ids


def streams_in_flight(router: Router, prompt: list[int], max_tokens: int, n_grpc: int,
                      n_http: int):
    """Start the streams; return (their results list, threads) once each has a token."""
    results: list = [None] * (n_grpc + n_http)
    events = [threading.Event() for _ in results]

    def one(i: int) -> None:
        if i < n_grpc:
            results[i] = grpc_stream(router.address, prompt, max_tokens, events[i])
        else:
            results[i] = sse_call(router, prompt, max_tokens, events[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(results))]
    for t in threads:
        t.start()
    for e in events:
        assert e.wait(120), "a stream got no token"
    return results, threads


def test_sigterm_refuses_new_requests_and_lets_streams_finish(tiny_cluster):
    router = start_router(tiny_cluster, "--shutdown-grace-s", "60")
    prompt = prompt_ids(tiny_cluster, "Finish what you started. ")
    kind, (ids, text) = grpc_call(router.address, prompt, 480)
    assert kind == "ok" and len(ids) == 480
    results, threads = streams_in_flight(router, prompt, 480, 6, 4)
    router.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        wait_for("NOT_SERVING", lambda: health_status(router.address) == NOT_SERVING, 10)
        kind, (details, hint) = grpc_call(router.address, prompt, 4)
        assert kind == "UNAVAILABLE" and "router shutting down" in details and float(hint) > 0
        status, (hint, err) = http_call(router, prompt, 4)
        assert status == 503 and int(hint) >= 1 and "router shutting down" in \
            err["error"]["message"]
        r = httpx.get(f"http://{router.http}/health", timeout=30)
        assert r.status_code == 503 and r.json()["status"] == "shutting_down"
        assert not all(r is not None for r in results), "the streams ended before the checks"
        for t in threads:
            t.join(120)
        assert results[:6] == [("ok", ids)] * 6
        assert results[6:] == [("ok", text)] * 4
        assert router.proc.wait(timeout=70) == 0
        assert time.monotonic() - sent < 60
    finally:
        stop_process(router.proc, timeout_s=30)


def test_streams_still_running_at_the_deadline_end_with_a_clear_status(tiny_cluster):
    prompt = prompt_ids(tiny_cluster, "A story that goes on and on. ")
    # A grace a fifth of what one such stream takes on this host: the streams outlive it.
    probe = start_router(tiny_cluster)
    try:
        t0 = time.monotonic()
        assert grpc_call(probe.address, prompt, 480)[0] == "ok"
        grace_s = (time.monotonic() - t0) / 5
    finally:
        stop_process(probe.proc, timeout_s=30)
    router = start_router(tiny_cluster, "--shutdown-grace-s", f"{grace_s:.3f}")
    results, threads = streams_in_flight(router, prompt, 480, 3, 1)
    router.proc.send_signal(signal.SIGTERM)
    sent = time.monotonic()
    try:
        for t in threads:
            t.join(120)
        assert router.proc.wait(timeout=30) == 0
        assert time.monotonic() - sent < 10
        ended = [r for r in results[:3] if r[0] != "ok"]
        assert ended, "every stream finished within the grace: nothing was cut"
        for kind, (details, hint) in ended:
            assert kind == "UNAVAILABLE" and details.startswith("router shutting down")
            assert float(hint) > 0
        kind, value = results[3]
        assert kind == "ok" or (value["code"] == "service_unavailable"
                                and "router shutting down" in value["message"]), results[3]
    finally:
        stop_process(router.proc, timeout_s=30)
