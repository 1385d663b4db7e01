"""The two processes of `pdserve bench transfer`: a prefill side and a decode side, one TCP link.

Owns the wire (frames of at most FRAME_BYTES; a priority queue in the sender so that anchor planes
and control messages always go before residual planes), the optional token-bucket pacer (the
emulated link when no `tc` shaping is possible), and what each side does for one job:

- prefill side: prefill the prompt with the variant's per-layer hook, send the KV the variant
  sends, then a `first` message (first token, prefill end time, piece counts); relay the decode
  side's result to its stdout as one JSON line per job.
- decode side: assemble the pieces as they arrive, join the request when the variant allows
  (progressive: approximately, on `kvcodec.dequantize_anchor` KV), step, time every token.

Timestamps are `time.monotonic()`: CLOCK_MONOTONIC is shared across network namespaces, so the
two processes' times are comparable. Must not decide what a sweep runs or summarize results.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import queue
import socket
import struct
import sys
import threading
import time
from typing import Any

import torch

FRAME_BYTES = 256 << 10
SNDBUF_BYTES = 128 << 10  # small: what the kernel buffers (Linux doubles it) no anchor can overtake
PACER_BURST_BYTES = 16 << 10  # the emulated link's bucket: an idle link saves up this much
HEADER = struct.Struct("<BHIIQQI")  # kind, layer, start, end, offset, total, nbytes
CTRL, FULL, ANCHOR, RESID, INT8, ALL = 0, 1, 2, 3, 4, 5
VARIANTS = ("full-after", "full-layerwise", "int8-layerwise", "progressive")


# ---- wire ------------------------------------------------------------------------------------
class Sender:
    """Sends pieces from a thread; lower priority numbers first, FIFO within a priority. With
    `rate_bps` set, a token bucket paces the bytes (the emulated link)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.rate_bps: float | None = None
        self._heap: list[tuple[int, int, bytes, memoryview]] = []
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._idle = threading.Event()
        self._idle.set()
        self._bytes_sent = 0
        threading.Thread(target=self._loop, daemon=True).start()

    def put(self, kind: int, layer: int, start: int, end: int, payload: Any, prio: int = 0) -> int:
        view = memoryview(payload).cast("B")
        total = view.nbytes
        with self._cv:
            for off in range(0, max(total, 1), FRAME_BYTES):
                part = view[off:off + FRAME_BYTES]
                hdr = HEADER.pack(kind, layer, start, end, off, total, part.nbytes)
                heapq.heappush(self._heap, (prio, next(self._seq), hdr, part))
            self._idle.clear()
            self._cv.notify()
        return total

    def ctrl(self, msg: dict[str, Any], prio: int = 0) -> None:
        self.put(CTRL, 0, 0, 0, json.dumps(msg).encode(), prio)

    def drain(self) -> None:
        self._idle.wait()

    def _loop(self) -> None:
        tokens, last = 0.0, time.monotonic()
        while True:
            with self._cv:
                while not self._heap:
                    self._idle.set()
                    self._cv.wait()
                _, _, hdr, part = heapq.heappop(self._heap)
            n = len(hdr) + part.nbytes
            if self.rate_bps:
                rate, burst = self.rate_bps / 8, float(PACER_BURST_BYTES)
                now = time.monotonic()
                tokens = min(burst, tokens + (now - last) * rate)
                last = now
                if tokens < n:  # the frame leaves when the bucket has paid for all of it
                    time.sleep((n - tokens) / rate)
                    now = time.monotonic()
                    tokens, last = tokens + (now - last) * rate, now
                tokens -= n
            self.sock.sendall(hdr)
            self.sock.sendall(part)


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < view.nbytes:
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the link")
        got += n


class Receiver:
    """Reads frames on a thread; each complete piece goes to `pieces` as
    (kind, layer, start, end, bytearray, arrival monotonic time)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pieces: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, daemon=True).start()

    def _loop(self) -> None:
        partial: dict[tuple[int, int, int], list] = {}
        hdr = bytearray(HEADER.size)
        try:
            while True:
                recv_exact(self.sock, memoryview(hdr))
                kind, layer, start, end, off, total, n = HEADER.unpack(hdr)
                key = (kind, layer, start)
                slot = partial.get(key)
                if slot is None:
                    slot = partial[key] = [bytearray(total), 0]
                recv_exact(self.sock, memoryview(slot[0])[off:off + n])
                slot[1] += n
                if slot[1] >= total:
                    del partial[key]
                    self.pieces.put((kind, layer, start, end, slot[0], time.monotonic()))
        except (ConnectionError, OSError) as e:
            self.pieces.put((None, 0, 0, 0, str(e), time.monotonic()))

    def get(self, timeout: float | None = None):
        kind, layer, start, end, buf, t = self.pieces.get(timeout=timeout)
        if kind is None:
            raise ConnectionError(buf)
        return kind, layer, start, end, buf, t

    def ctrl(self, timeout: float | None = None) -> dict[str, Any]:
        kind, _, _, _, buf, _ = self.get(timeout)
        assert kind == CTRL, kind
        return json.loads(bytes(buf))


# ---- int8 baseline ---------------------------------------------------------------------------
def quantize_int8(x: torch.Tensor) -> bytes:
    """Per-token-per-head absmax int8 (symmetric) over the last dim: int8 values, then fp32 scales."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(1e-30)
    q = torch.round(x / scale).clamp_(-127, 127).to(torch.int8)
    return q.numpy().tobytes() + scale.squeeze(-1).float().numpy().tobytes()


def dequantize_int8(buf: bytearray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    q = torch.frombuffer(buf, dtype=torch.int8, count=n).view(shape)
    scale = torch.frombuffer(buf, dtype=torch.float32, offset=n, count=n // shape[-1])
    return (q.float() * scale.view(*shape[:-1], 1)).to(dtype)


# ---- engines ---------------------------------------------------------------------------------
def make_engine(model: str, max_prompt: int, max_tokens: int, chunk: int):
    from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.engine import LLMEngine

    blocks = 2 * (-(-(max_prompt + max_tokens + 32) // 16)) + 64
    return LLMEngine(EngineConfig(
        model, cache=CacheConfig(block_size_tokens=16, num_blocks=blocks,
                                 enable_prefix_caching=False),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=chunk)))


def warm_up(engine, n_tokens: int, max_tokens: int) -> None:
    """One request through the engine, and the codec once (the C backend compiles on first use)."""
    from pdserve.engine import kvcodec
    from pdserve.engine.sampling import SamplingParams

    x = torch.randn(4, 64)
    a, r = kvcodec.split(x)
    kvcodec.join(a, r, x.dtype, x.shape)
    kvcodec.dequantize_anchor(a, x.dtype, x.shape)

    prompt = [(7 * i + 3) % engine.model_config.vocab_size for i in range(n_tokens)]
    engine.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))


# ---- prefill side ----------------------------------------------------------------------------
def prefill_job(engine, send: Sender, job: dict[str, Any]) -> dict[str, Any]:
    """Prefill with the variant's per-layer hook; returns what the `first` message says."""
    from pdserve.engine import kvcodec
    from pdserve.engine.sampling import SamplingParams

    variant, rid = job["variant"], job["rid"]
    resid_s = job.get("est_residual_s")
    fallback = (variant == "progressive" and resid_s is not None
                and resid_s < job.get("decode_step_s", 0.0))
    counts = {FULL: 0, ANCHOR: 0, RESID: 0, INT8: 0, ALL: 0}
    sent = {"kv_bytes": 0, "anchor_bytes": 0, "residual_bytes": 0}

    def on_layer(li: int, spans: list[tuple[str, int, int]]) -> None:
        for r, s, e in spans:
            if r != rid:
                continue
            k, v = engine.read_layer_kv(r, li, s, e)
            x = torch.stack((k, v))  # [2, e - s, kv_heads, head_dim]
            if variant == "int8-layerwise":
                sent["kv_bytes"] += send.put(INT8, li, s, e, quantize_int8(x))
                counts[INT8] += 1
            elif variant == "progressive" and not fallback:
                a, res = kvcodec.split(x)
                n_a = send.put(ANCHOR, li, s, e, a.numpy(), prio=0)
                n_r = send.put(RESID, li, s, e, res.numpy(), prio=1)
                sent["anchor_bytes"] += n_a
                sent["residual_bytes"] += n_r
                sent["kv_bytes"] += n_a + n_r
                counts[ANCHOR] += 1
                counts[RESID] += 1
            else:
                sent["kv_bytes"] += send.put(FULL, li, s, e, x.numpy())
                counts[FULL] += 1

    engine.on_prefill_layer = None if variant == "full-after" else on_layer
    params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
    t0 = time.monotonic()
    engine.add_request(rid, job["prompt"], params, prefill_only=True)
    first = None
    while first is None:
        for o in engine.step():
            if o.prefill_done:
                first = o.new_token_ids[0]
    t_end = time.monotonic()
    engine.on_prefill_layer = None
    msg: dict[str, Any] = {"op": "first", "first_token": first, "t_prefill_end": t_end,
                           "prefill_s": t_end - t0, "fallback": fallback}
    if variant == "full-after":
        kv = engine.take_parked_kv(rid)  # the copy out is part of the wait it causes
        n = len(job["prompt"])
        x = torch.cat(kv.blocks, dim=2)[:, :, :n].contiguous()  # [layers, 2, n, heads, dim]
        msg["counts"] = {str(ALL): 1}
        send.ctrl({**msg, **sent, "kv_bytes": x.numel() * x.element_size()})
        send.put(ALL, 0, 0, n, x.numpy())
    else:
        engine.release_parked(rid)
        msg["counts"] = {str(k): v for k, v in counts.items() if v}
        send.ctrl({**msg, **sent})
    return msg


def prefill_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    engine = make_engine(args.model, args.max_prompt, args.max_tokens, args.chunk)
    warm_up(engine, min(64, args.max_prompt), 2)
    sock = socket.create_connection((args.connect_host, args.connect_port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
    send, recv = Sender(sock), Receiver(sock)
    print(json.dumps({"op": "ready"}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("op") == "quit":
            send.ctrl({"op": "quit"})
            send.drain()
            break
        send.rate_bps = job["pace_gbps"] * 1e9 if job.get("pace_gbps") else None
        send.ctrl({"op": "job", **job})
        assert recv.ctrl()["op"] == "ready"
        prefill_job(engine, send, job)
        result = recv.ctrl()
        assert result["op"] == "result", result
        print(json.dumps(result), flush=True)
    return 0


# ---- decode side -----------------------------------------------------------------------------
class Assembly:
    """One job's KV as it arrives: the exact tensor, the approximate one (progressive), counts."""

    def __init__(self, engine, n: int, variant: str) -> None:
        mc = engine.model_config
        bs = engine.block_size
        self.n, self.variant = n, variant
        self.padded = -(-n // bs) * bs
        self.shape = (mc.num_hidden_layers, 2, self.padded, mc.num_key_value_heads, mc.head_dim)
        self.dtype = engine.kv.k.dtype
        self.exact = torch.zeros(self.shape, dtype=self.dtype)
        self.approx = torch.zeros(self.shape, dtype=self.dtype) if variant == "progressive" else None
        self.anchors: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}
        self.got = {FULL: 0, ANCHOR: 0, RESID: 0, INT8: 0, ALL: 0}
        self.first: dict[str, Any] | None = None
        self.t_last_kv = 0.0
        self.t_anchors_in = 0.0

    def piece_shape(self, s: int, e: int) -> tuple[int, ...]:
        return (2, e - s, self.shape[3], self.shape[4])

    def add(self, kind: int, li: int, s: int, e: int, buf: bytearray, t: float) -> None:
        from pdserve.engine import kvcodec

        if kind == CTRL:
            self.first = json.loads(bytes(buf))
            return
        self.got[kind] += 1
        self.t_last_kv = t
        if kind == ALL:
            x = torch.frombuffer(buf, dtype=self.dtype).view(
                self.shape[0], 2, e - s, self.shape[3], self.shape[4])
            self.exact[:, :, s:e] = x
        elif kind == FULL:
            self.exact[li, :, s:e] = torch.frombuffer(buf, dtype=self.dtype).view(self.piece_shape(s, e))
        elif kind == INT8:
            self.exact[li, :, s:e] = dequantize_int8(buf, self.piece_shape(s, e), self.dtype)
        elif kind == ANCHOR:
            a = torch.frombuffer(buf, dtype=torch.uint8)
            self.anchors[(li, s)] = (a, e)
            self.approx[li, :, s:e] = kvcodec.dequantize_anchor(a, self.dtype, self.piece_shape(s, e))
            self.t_anchors_in = t
        elif kind == RESID:
            a, _ = self.anchors.pop((li, s))
            r = torch.frombuffer(buf, dtype=torch.uint8)
            self.exact[li, :, s:e] = kvcodec.join(a, r, self.dtype, self.piece_shape(s, e))

    def expected(self, kind: int) -> int:
        assert self.first is not None
        return int(self.first["counts"].get(str(kind), 0))

    def can_start(self) -> bool:
        if self.first is None:
            return False
        need = [k for k in (ALL, FULL, INT8, ANCHOR) if self.expected(k)]
        return all(self.got[k] >= self.expected(k) for k in need)

    def exact_in(self) -> bool:
        return self.first is not None and self.got[RESID] >= self.expected(RESID)

    def blocks(self, t: torch.Tensor, bs: int) -> list[torch.Tensor]:
        return [t[:, :, i:i + bs] for i in range(0, self.padded, bs)]


def decode_job(engine, recv: Receiver, send: Sender, job: dict[str, Any]) -> dict[str, Any]:
    from pdserve.core.block_hash import prompt_block_hashes
    from pdserve.engine.sampling import SamplingParams

    rid, prompt, variant = job["rid"], job["prompt"], job["variant"]
    asm = Assembly(engine, len(prompt), variant)
    before = engine.stats()
    send.ctrl({"op": "ready"})
    while not asm.can_start():
        asm.add(*recv.get())
    t_join = time.monotonic()
    first = asm.first
    bs = engine.block_size
    hashes = prompt_block_hashes(prompt, bs, salt=rid, include_partial=True)
    progressive = asm.expected(ANCHOR) > 0
    source = asm.approx if progressive else asm.exact
    params = SamplingParams(max_tokens=job["max_tokens"], ignore_eos=True)
    engine.add_prefilled_request(rid, prompt, first["first_token"], params,
                                 list(zip(hashes, asm.blocks(source, bs))), approximate=progressive)
    tokens, times = [first["first_token"]], [first["t_prefill_end"]]
    t_exact = None if progressive else t_join
    done = False
    while not done:
        while True:  # whatever arrived meanwhile, without waiting
            try:
                asm.add(*recv.get(timeout=0))
            except queue.Empty:
                break
        if progressive and t_exact is None and asm.exact_in():
            engine.finish_anchor(rid, list(zip(hashes, asm.blocks(asm.exact, bs))))
            t_exact = time.monotonic()
        if not engine.has_work():  # paused on the anchor: wait for the residual
            asm.add(*recv.get())
            continue
        for o in engine.step():
            t = time.monotonic()
            tokens.extend(o.new_token_ids)
            times.extend([t] * len(o.new_token_ids))
            done = done or o.finished
    after = engine.stats()
    t0 = first["t_prefill_end"]
    return {
        "op": "result", "variant": variant, "rid": rid, "tokens": tokens,
        "token_s": [t - t0 for t in times], "wait_s": t_join - t0,
        "exact_kv_s": (t_exact or t_join) - t0, "transfer_end_s": asm.t_last_kv - t0,
        "anchors_in_s": (asm.t_anchors_in - t0) if progressive else None,
        "prefill_s": first["prefill_s"], "fallback": first["fallback"],
        "kv_bytes": first["kv_bytes"], "anchor_bytes": first["anchor_bytes"],
        "residual_bytes": first["residual_bytes"],
        **{k: after[k] - before[k] for k in ("anchor_num_drafts", "anchor_num_draft_tokens",
                                              "anchor_num_accepted_tokens")},
    }


def decode_main(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    engine = make_engine(args.model, args.max_prompt, args.max_tokens, args.chunk)
    warm_up(engine, min(64, args.max_prompt), 17)
    lsock = socket.socket()
    lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind((args.listen_host, 0))
    lsock.listen(1)
    print(json.dumps({"op": "listening", "port": lsock.getsockname()[1]}), flush=True)
    sock, _ = lsock.accept()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
    send, recv = Sender(sock), Receiver(sock)
    while True:
        job = recv.ctrl()
        if job["op"] == "quit":
            break
        send.ctrl(decode_job(engine, recv, send, job))
    send.drain()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.transfer_proc")
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--model", required=True)
    p.add_argument("--max-prompt", type=int, required=True)
    p.add_argument("--max-tokens", type=int, default=10)
    p.add_argument("--chunk", type=int, default=2048, help="prefill tokens per step")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--listen-host", default="127.0.0.1")
    p.add_argument("--connect-host", default="127.0.0.1")
    p.add_argument("--connect-port", type=int, default=0)
    args = p.parse_args(argv)
    return prefill_main(args) if args.role == "prefill" else decode_main(args)


if __name__ == "__main__":
    sys.exit(main())
