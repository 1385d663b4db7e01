"""The prefill side of progressive KV transfer: stream each layer's KV to the store as computed.

Owns the streamed requests' state and one sender thread. `on_layer` runs on the engine thread
(installed as `engine.on_prefill_layer`) and only copies the layer's K/V (`read_layer_kv`) and
enqueues them; the sender thread splits them with kvcodec and puts the ANCHOR object at once and
the RESIDUAL object later: layers waiting to be split (whose anchors go next) always come before
queued residuals, so every anchor known to the sender is in the store before any residual still
queued. Never blocks the engine thread: past `max_queue_bytes` a request stops streaming and is
marked fallen back (the prefill role then puts it as whole blocks, the plain transfer).
On a GPU the split runs there (the codec's Triton kernels) and each plane reaches the store
through host staging (`kv_staging`: a pinned buffer, an asynchronous copy, an event waited).
A failed put is logged and counted; the decode side then times out waiting for that object and
recomputes the prompt's missing KV (slower, never wrong). Must not decide routing.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field


from pdserve.worker.kv_staging import HostStaging, default_staging
from pdserve.worker.kv_stream import plane_meta, split_layer, stream_key
from pdserve.worker.torch_lazy import torch

log = logging.getLogger(__name__)


@dataclass
class _Stream:
    """One request being streamed. `ok` turns False for good on overflow, a non-contiguous
    span (a recompute after preemption) or the end of the request (nothing more to send)."""

    model_id: str
    stream_id: str
    spans: list[tuple[int, int]] = field(default_factory=list)
    ok: bool = True
    active: bool = True  # False once the role is done with it: queued items are skipped if not ok


@dataclass
class _Layer:
    stream: _Stream
    start: int
    end: int
    layer: int
    k: torch.Tensor
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class KvStreamSender:
    def __init__(self, engine, store, max_queue_bytes: int = 256 << 20,
                 staging: HostStaging | None = None) -> None:
        self.engine = engine
        self.store = store
        self.staging = staging or default_staging()
        self.max_queue_bytes = max_queue_bytes
        self._streams: dict[str, _Stream] = {}  # touched on the engine thread and the role's
        self._layers: deque[_Layer] = deque()
        self._residuals: deque[tuple[_Stream, str, torch.Tensor]] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kv-stream-sender", daemon=True)
        self.layers_put = 0  # (span, layer) anchor + residual pairs stored
        self.put_failures = 0
        self.fallbacks = 0
        self.put_order: list[str] | None = None  # keys in put order, when a test asks for it

    def start(self) -> "KvStreamSender":
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # ---- the role's side -----------------------------------------------------------------
    def register(self, request_id: str, model_id: str, stream_id: str) -> None:
        """Stream this request's layers from its next prefill step on (call on the engine
        thread, in the same `call` that adds the request)."""
        self._streams[request_id] = _Stream(model_id, stream_id)

    def finish(self, request_id: str) -> list[tuple[int, int]] | None:
        """The request's prefill is over: its spans if every layer was queued, else None (the
        caller puts whole blocks instead; whatever of it is still queued is dropped then)."""
        s = self._streams.pop(request_id, None)
        if s is None:
            return None
        with self._cond:
            s.active = False
            if not s.ok or not s.spans:
                s.ok = False
                self.fallbacks += 1
                return None
        return list(s.spans)

    # ---- the engine thread -----------------------------------------------------------------
    def on_layer(self, layer: int, spans: list[tuple[str, int, int]]) -> None:
        for rid, start, end in spans:
            s = self._streams.get(rid)
            if s is None or not s.ok or end <= start:
                continue
            if layer == 0:
                if s.spans and s.spans[-1][1] != start:  # recomputed after preemption
                    s.ok = False
                    continue
                s.spans.append((start, end))
            k, v = self.engine.read_layer_kv(rid, layer, start, end)
            item = _Layer(s, start, end, layer, k, v)
            with self._cond:
                if self._queued_bytes + item.nbytes > self.max_queue_bytes:
                    log.warning("kv stream queue over %d bytes: %s falls back to whole blocks",
                                self.max_queue_bytes, rid)
                    s.ok = False
                    continue
                self._queued_bytes += item.nbytes
                self._layers.append(item)
                self._cond.notify()

    # ---- the sender thread -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stop or self._layers or self._residuals)
                if self._stop:
                    return
                if self._layers:  # anchors first
                    item, res = self._layers.popleft(), None
                else:
                    item, res = None, self._residuals.popleft()
            if item is not None:
                self._send_layer(item)
            else:
                assert res is not None
                s, key, plane = res
                if s.ok or s.active:
                    self._put(key, plane)
                    with self._cond:
                        self.layers_put += 1
                with self._cond:
                    self._queued_bytes -= plane.numel()

    def _send_layer(self, item: _Layer) -> None:
        s = item.stream
        skip = not s.ok and not s.active
        anchor = residual = None
        if not skip:
            anchor, residual = split_layer(item.k, item.v)
            key = stream_key(s.model_id, s.stream_id, item.start, item.end, item.layer, "anchor")
            self._put(key, anchor)
        with self._cond:
            self._queued_bytes -= item.nbytes
            if residual is not None:
                self._queued_bytes += residual.numel()
                self._residuals.append((s, stream_key(s.model_id, s.stream_id, item.start,
                                                      item.end, item.layer, "residual"),
                                        residual))

    def _put(self, key: str, plane: torch.Tensor) -> None:
        if self.put_order is not None:
            self.put_order.append(key)
        try:
            with self.staging.host_views([plane]) as (view,):  # a device plane: staged
                self.store.batch_put_from([(key, view, plane_meta(plane))])
        except Exception as e:  # any store error: the reader times out and recomputes
            log.warning("kv stream put %s failed: %s", key, e)
            with self._cond:
                self.put_failures += 1
