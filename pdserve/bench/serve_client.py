"""The client of `pdserve bench serve`: OpenAI streaming requests over plain HTTP/1.1.

Owns sending one request and timing its server-sent events (`stream_one`: the send, each chunk
that carries text or a tool call's name or argument text, the usage at the end), a closed loop at a
fixed concurrency (`run_closed`: every request sent as soon as one of `concurrency` slots is
free, as `benchmark_serving --max-concurrency`), and an open-loop replay at the requests'
arrival times (`run_open`). The same code drives every server measured, so their figures
compare. Uses the standard library's `http.client` (one connection per request, one thread per
request in flight).
Must not retry a request or hide an error: each row records what happened.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from pdserve.bench.serve_workload import Request


def _error_text(status: int, raw: bytes) -> str:
    try:
        msg = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = raw[:200].decode("utf-8", "replace")
    return f"HTTP {status}: {msg}"


def _delta_text(delta: dict[str, Any]) -> str:
    """A chat chunk's text: its content, or the tool calls it carries (a call's function name
    when it opens, then its argument text)."""
    if delta.get("content"):
        return delta["content"]
    return "".join(((c.get("function") or {}).get("name") or "")
                   + ((c.get("function") or {}).get("arguments") or "")
                   for c in delta.get("tool_calls") or ())


def stream_one(address: str, req: Request, model: str, timeout_s: float,
               clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """Send `req` to `address` ("host:port") and read its stream to the end.

    The row: `error` (None, or what went wrong), `output_tokens` (the usage's completion
    tokens; without usage, the chunks with text: content, or a tool call's name or arguments),
    `expected_tokens`, `prompt_tokens` (the usage's; None without usage), `ttft_s` and
    `chunk_times_s` (from the send), `e2e_s`, `start_s`/`end_s` (on `clock`)."""
    host, port = address.rsplit(":", 1)
    body = json.dumps({**req.body, "model": model}).encode()
    times: list[float] = []
    usage_tokens = prompt_tokens = None
    error = None
    finish = None
    start = clock()
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        conn.request("POST", req.path, body=body,
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            error = _error_text(resp.status, resp.read())
        else:
            while True:
                line = resp.readline()
                if not line:
                    error = "the stream ended without [DONE]"
                    break
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                now = clock()
                obj = json.loads(data)
                if obj.get("error"):
                    error = f"stream error: {obj['error'].get('message', obj['error'])}"
                    break
                if obj.get("usage"):
                    usage_tokens = obj["usage"].get("completion_tokens")
                    prompt_tokens = obj["usage"].get("prompt_tokens")
                for ch in obj.get("choices") or ():
                    delta = ch.get("delta")
                    text = _delta_text(delta or {}) if "delta" in ch else ch.get("text")
                    if text:
                        times.append(now - start)
                    finish = ch.get("finish_reason") or finish
    except (OSError, http.client.HTTPException, ValueError) as e:
        error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    end = clock()
    if error is None and finish is None:
        error = "no finish_reason"
    tokens = usage_tokens if usage_tokens is not None else len(times)
    return {"error": error, "output_tokens": tokens, "expected_tokens": req.max_tokens,
            "prompt_tokens": prompt_tokens,
            "finish_reason": finish, "ttft_s": times[0] if times else None,
            "chunk_times_s": times, "e2e_s": end - start, "start_s": start, "end_s": end}


def run_closed(address: str, model: str, reqs: Sequence[Request], concurrency: int,
               timeout_s: float, on_done: Callable[[], None] = lambda: None
               ) -> tuple[list[dict[str, Any]], float]:
    """Every request, at most `concurrency` in flight; (rows in request order, wall seconds
    from the first send to the last end)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    rows: list[dict[str, Any] | None] = [None] * len(reqs)
    nxt = iter(range(len(reqs)))
    lock = threading.Lock()

    def slot() -> None:
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            rows[i] = stream_one(address, reqs[i], model, timeout_s)
            on_done()

    threads = [threading.Thread(target=slot, daemon=True)
               for _ in range(min(concurrency, len(reqs)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done = [r for r in rows if r is not None]
    return done, _wall(done)


def run_open(address: str, model: str, reqs: Sequence[Request], timeout_s: float,
             on_done: Callable[[], None] = lambda: None) -> tuple[list[dict[str, Any]], float]:
    """Each request sent at its `arrival_s` from now (one thread each); (rows, wall seconds).
    A row's `ttft_s` counts from its send, which is its arrival unless this machine lagged."""
    rows: list[dict[str, Any] | None] = [None] * len(reqs)

    def one(i: int) -> None:
        rows[i] = stream_one(address, reqs[i], model, timeout_s)
        on_done()

    t0 = time.perf_counter()
    threads = []
    for i, r in enumerate(reqs):
        delay = t0 + (r.arrival_s or 0.0) - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        t = threading.Thread(target=one, args=(i,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    done = [r for r in rows if r is not None]
    return done, _wall(done)


def _wall(rows: Sequence[dict[str, Any]]) -> float:
    if not rows:
        return 0.0
    return max(r["end_s"] for r in rows) - min(r["start_s"] for r in rows)


def mean_in_flight(rows: Sequence[dict[str, Any]], wall_s: float) -> float:
    """Requests in flight on average over the run (their summed durations / wall)."""
    return sum(r["e2e_s"] for r in rows) / wall_s if wall_s > 0 else 0.0
