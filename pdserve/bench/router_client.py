"""The load of `pdserve bench router`: open-loop streamed chat completions at a set rate.

Owns one asyncio client that sends requests at Poisson arrival times for a window, over the
OpenAI HTTP API (its own HTTP/1.1 and server-sent-events reader on a socket per request,
light enough that the client is not what a 2-core host runs out of first) or over gRPC
(`Generation.Generate` with chat input, on a pool of connections so that routers sharing a
port each get some), and records per request: the status, the time to the first token, the
gaps between streamed chunks and the tokens the usage reports. Must not start processes or
judge the figures: `bench/router.py` does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

# Requests in flight the client holds at most; past it an arrival is counted as dropped (the
# figures then say the client could not keep the rate).
MAX_OUTSTANDING = 4096
GRPC_CONNECTIONS = 16


@dataclass
class Row:
    ok: bool = False
    status: str = ""  # "ok", an HTTP status or a gRPC code name, or the exception
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)  # between chunks carrying tokens
    tokens: int = 0  # the usage's completion tokens
    retry_after: str = ""
    _last_s: float = 0.0

    def chunk(self, at_s: float) -> None:
        """A chunk carrying tokens arrived `at_s` after the send."""
        if self.ttft_s is None:
            self.ttft_s = at_s
        else:
            self.gaps_s.append(at_s - self._last_s)
        self._last_s = at_s


def _http_request(host: str, port: int, body: bytes) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s:%d\r\n"
            b"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n"
            % (host.encode(), port, len(body))) + body


async def http_chat(host: str, port: int, body: bytes, timeout_s: float) -> Row:
    row = Row()
    start = time.perf_counter()
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError) as e:
        row.status = type(e).__name__
        return row
    try:
        writer.write(_http_request(host, port, body))
        status = (await reader.readline()).split(b" ", 2)
        code = int(status[1]) if len(status) > 1 else 0
        headers: dict[bytes, bytes] = {}
        while True:
            line = await reader.readline()
            if line in (b"\r\n", b"\n", b""):
                break
            k, _, v = line.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if code != 200:
            row.status = str(code)
            row.retry_after = headers.get(b"retry-after", b"").decode()
            return row
        buf = b""
        while True:
            size = int((await reader.readline()).strip() or b"0", 16)
            if size == 0:
                break
            buf += (await reader.readexactly(size + 2))[:-2]
            while b"\n\n" in buf:
                event, buf = buf.split(b"\n\n", 1)
                if event.startswith(b"data: [DONE]"):
                    row.ok = True
                    row.status = "ok"
                    continue
                if b'"usage":{' in event:
                    row.tokens = json.loads(event[6:])["usage"]["completion_tokens"]
                if b'"content":"' in event and b'"content":""' not in event:
                    row.chunk(time.perf_counter() - start)
        if not row.ok:
            row.status = "the stream ended without [DONE]"
    except (OSError, asyncio.IncompleteReadError, ValueError, KeyError) as e:
        row.status = f"{type(e).__name__}: {e}"
        row.ok = False
    finally:
        writer.close()
    return row


class GrpcPool:
    """A few connections to the router port (each its own, so routers sharing the port each
    take some), handed out in turn."""

    def __init__(self, address: str, connections: int = GRPC_CONNECTIONS) -> None:
        from pdserve import rpc
        from pdserve.proto import api_pb2_grpc

        self.channels = [rpc.make_public_aio_channel(address, own_connection=True)
                         for _ in range(connections)]
        self.stubs = [api_pb2_grpc.GenerationStub(c) for c in self.channels]
        self.next = 0

    def stub(self):
        self.next = (self.next + 1) % len(self.stubs)
        return self.stubs[self.next]

    async def close(self) -> None:
        for c in self.channels:
            await c.close()


async def grpc_chat(pool: GrpcPool, request, timeout_s: float) -> Row:
    import grpc

    row = Row()
    start = time.perf_counter()
    try:
        async for r in pool.stub().Generate(request, timeout=timeout_s):
            if r.token_ids:
                row.chunk(time.perf_counter() - start)
            if r.finish_reason:
                row.tokens = r.usage.completion_tokens
        row.ok, row.status = True, "ok"
    except grpc.aio.AioRpcError as e:
        row.status = e.code().name
        row.retry_after = dict(e.trailing_metadata() or ()).get("retry-after", "")
    return row


def chat_body(model: str, messages: list[dict[str, str]], max_tokens: int) -> bytes:
    return json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": True},
                       "ignore_eos": True, "temperature": 0}).encode()


def grpc_request(messages: list[dict[str, str]], max_tokens: int):
    from pdserve.proto import api_pb2, common_pb2

    req = api_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(
        max_tokens=max_tokens, ignore_eos=True))
    for m in messages:
        req.chat.messages.add(role=m["role"], content=m["content"])
    return req


async def open_loop(api: str, address: str, model: str, prompts: list[list[dict[str, str]]],
                    rate: float, window_s: float, max_tokens: int, seed: int = 0,
                    timeout_s: float = 120.0) -> dict[str, Any]:
    """Arrivals at `rate` per second (Poisson) for `window_s`; waits for every stream to end.
    {"rows": [...], "sent": n, "dropped": n, "wall_s": from the first send to the last end}."""
    rng = random.Random(seed)
    host, _, port = address.rpartition(":")
    pool = GrpcPool(address) if api == "grpc" else None
    tasks: list[asyncio.Task] = []
    dropped = 0
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    at = 0.0
    i = 0
    try:
        while at < window_s:
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            messages = prompts[i % len(prompts)]
            i += 1
            if sum(1 for t in tasks if not t.done()) >= MAX_OUTSTANDING:
                dropped += 1
            elif pool is None:
                tasks.append(asyncio.ensure_future(http_chat(
                    host, int(port), chat_body(model, messages, max_tokens), timeout_s)))
            else:
                tasks.append(asyncio.ensure_future(grpc_chat(
                    pool, grpc_request(messages, max_tokens), timeout_s)))
            at += rng.expovariate(rate)
        rows = await asyncio.gather(*tasks)
    finally:
        if pool is not None:
            await pool.close()
    return {"rows": rows, "sent": len(tasks), "dropped": dropped,
            "wall_s": loop.time() - t0}
