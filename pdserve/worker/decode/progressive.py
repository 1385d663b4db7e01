"""The decode side of progressive KV transfer: read a streamed request's planes from the store.

Owns waiting for the stream's objects (polling the store with a short sleep until a deadline),
turning them into engine blocks [layers, 2, block_size, kv_heads, head_dim], and the residual
thread that brings the exact KV to a request joined on anchors. Three outcomes per request:

- every anchor in, some residual not: join on anchor-precision blocks (`approximate=True`, the
  engine drafts on them), then a thread waits for the residuals, joins them with the kept
  anchors (bit-exact) and calls `engine.finish_anchor` (the drafts are verified);
- every anchor in and every residual already in the store: join exact directly (plain waiting
  was as fast; counted in `exact_joins`);
- anchors late past the wait: join with the exact prefix blocks only and let the engine
  recompute the rest of the prompt (`fallbacks`). Residuals late past the wait: the request,
  which has emitted nothing yet, is aborted in the engine and added again with the exact prefix
  blocks only, so the prompt is recomputed exactly (`fallbacks`). Slower, never wrong.
  A store that cannot answer while a plane is awaited (`StoreFailure`) ends the wait at once:
  the same fallback, without waiting out the deadline.
Must not decide routing.
"""

from __future__ import annotations

import logging
import threading
import time


from pdserve.worker.guarded_store import StoreFailure
from pdserve.worker.kv_blocks import _MISSING
from pdserve.worker.kv_stream import StreamHandle, layer_shape, plane_sizes
from pdserve.worker.torch_lazy import torch

log = logging.getLogger(__name__)

Planes = "dict[tuple[tuple[int, int], int], torch.Tensor]"  # (span, layer) -> uint8 plane


class StreamReader:
    def __init__(self, store, engine, wait_s: float, poll_s: float = 0.005) -> None:
        self.store = store
        self.engine = engine
        self.wait_s = wait_s
        self.poll_s = poll_s

    def _sizes(self, h: StreamHandle, span: tuple[int, int]) -> tuple[int, int]:
        m = self.engine.model_config
        return plane_sizes(self.engine.model.dtype,
                           layer_shape(span[1] - span[0], m.num_key_value_heads, m.head_dim))

    def fetch(self, h: StreamHandle, plane: str, deadline: float,
              is_active=lambda: True) -> Planes | None:
        """Every (span, layer) object of one plane, layer by layer, polling until `deadline`;
        None if some did not arrive in time (or the caller went away)."""
        which = 0 if plane == "anchor" else 1
        want = [(s, li) for li in range(h.num_layers) for s in h.spans]
        got: Planes = {}
        while True:
            todo = [w for w in want if w not in got]
            try:
                present = (self.store.exists([h.key(s, li, plane) for s, li in todo])
                           if todo else [])
            except StoreFailure as e:
                log.warning("store failed while awaiting %s planes: %s", plane, e)
                return None
            for (s, li), p in zip(todo, present):
                if not p:
                    continue
                buf = torch.empty(self._sizes(h, s)[which], dtype=torch.uint8)
                try:
                    n = self.store.get_into(h.key(s, li, plane), buf.numpy())
                except _MISSING:
                    continue
                if n == buf.numel():
                    got[(s, li)] = buf
            if len(got) == len(want):
                return got
            if time.monotonic() > deadline or not is_active():
                return None
            time.sleep(self.poll_s)

    def all_present(self, h: StreamHandle, plane: str) -> bool:
        keys = [h.key(s, li, plane) for li in range(h.num_layers) for s in h.spans]
        try:
            return all(self.store.exists(keys))
        except StoreFailure:
            return False

    def to_blocks(self, h: StreamHandle, hashes: list[bytes], n_prompt: int,
                  planes: Planes, residuals: Planes | None
                  ) -> list[tuple[bytes, torch.Tensor]]:
        """The streamed blocks (from h.start to the prompt's end), anchor precision when
        `residuals` is None, else exact."""
        from pdserve.engine import kvcodec  # torch: only on this path
        e = self.engine
        m = e.model_config
        dtype = e.model.dtype
        bs = e.block_size
        dev = e.kv.k.device  # on a GPU the planes are joined there (the codec's Triton kernels)
        buf = torch.zeros(h.num_layers, 2, n_prompt - h.start, m.num_key_value_heads,
                          m.head_dim, dtype=dtype, device=dev)
        for (s, li), anchor in planes.items():
            shape = layer_shape(s[1] - s[0], m.num_key_value_heads, m.head_dim)
            if residuals is None:
                kv = kvcodec.dequantize_anchor(anchor.to(dev), dtype, shape)
            else:
                kv = kvcodec.join(anchor.to(dev), residuals[(s, li)].to(dev), dtype, shape)
            buf[li, :, s[0] - h.start:s[1] - h.start] = kv
        first = h.start // bs
        out = []
        for i in range(first, len(hashes)):
            a = i * bs - h.start
            n = min(bs, n_prompt - i * bs)
            block = torch.zeros(e.kv.block_shape(), dtype=dtype, device=dev)
            block[:, :, :n] = buf[:, :, a:a + n]
            out.append((hashes[i], block))
        return out


class ResidualWaiter:
    """The thread that brings one anchor-joined request its exact KV (or recomputes it)."""

    def __init__(self, loop, reader: StreamReader, request_id: str, h: StreamHandle,
                 hashes: list[bytes], n_prompt: int, anchors: Planes, prefix: list,
                 readd, on_fallback, cancelled: threading.Event) -> None:
        self.loop = loop
        self.reader = reader
        self.args = (request_id, h, hashes, n_prompt, anchors, prefix)
        self.readd = readd  # engine-thread function: abort and add again with `prefix` only
        self.on_fallback = on_fallback
        self.cancelled = cancelled
        self.thread = threading.Thread(target=self._run, name=f"residuals-{request_id}",
                                       daemon=True)

    def start(self) -> "ResidualWaiter":
        self.thread.start()
        return self

    def _run(self) -> None:
        rid, h, hashes, n_prompt, anchors, prefix = self.args
        engine = self.loop.engine
        try:
            res = self.reader.fetch(h, "residual", time.monotonic() + self.reader.wait_s,
                                    lambda: not self.cancelled.is_set())
            if self.cancelled.is_set():
                return
            if res is None:
                log.warning("residuals of %s late past %.1fs: recomputing the prompt", rid,
                            self.reader.wait_s)
                if self.loop.call(self.readd):
                    self.on_fallback()
                return
            exact = self.reader.to_blocks(h, hashes, n_prompt, anchors, res)
            blocks = [(hh, None) for hh, _ in prefix] + exact
            self.loop.call(lambda: engine.finish_anchor(rid, blocks))
        except Exception:  # a store or engine error: recompute rather than hang
            log.exception("residual fetch of %s failed: recomputing the prompt", rid)
            if not self.cancelled.is_set() and self.loop.call(self.readd):
                self.on_fallback()
