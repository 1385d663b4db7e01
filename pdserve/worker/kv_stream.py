"""Progressive KV transfer through the store: the stream's keys and the bytes of one object.

A prefill streams each (prefill chunk = span, layer) of a request as two store objects: the
ANCHOR (kvcodec's high-order plane of that layer's K and V over the span, small, put first) and
the RESIDUAL (the rest, put after every queued anchor). Keys:

    stream/<model_id quoted>/<stream_id quoted>/<start>-<end>/L<layer>/anchor|residual

Both planes code one tensor [2, end - start, kv_heads, head_dim] (K then V), so their sizes are
fixed by (dtype, shape) and a reader knows them before the bytes arrive. The router's KV index
ignores these keys (they are not block keys). Owns the format; must not do I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import quote


from pdserve.kvstore.store import ObjectMeta
from pdserve.worker.torch_lazy import torch

def stream_key(model_id: str, stream_id: str, start: int, end: int, layer: int,
               plane: str) -> str:
    assert plane in ("anchor", "residual")
    return (f"stream/{quote(model_id, safe='')}/{quote(stream_id, safe='')}/{start}-{end}/"
            f"L{layer}/{plane}")


@dataclass(frozen=True)
class StreamHandle:
    """What the decode side needs to read a streamed request (from the KvHandle)."""

    model_id: str
    stream_id: str
    spans: tuple[tuple[int, int], ...]  # contiguous prompt ranges, ending at the prompt's end
    num_layers: int
    kv_dtype: str

    def key(self, span: tuple[int, int], layer: int, plane: str) -> str:
        return stream_key(self.model_id, self.stream_id, span[0], span[1], layer, plane)

    @property
    def start(self) -> int:
        """First streamed position; the blocks before it are whole blocks (a cached prefix)."""
        return self.spans[0][0]


def layer_shape(n_tokens: int, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    return (2, n_tokens, kv_heads, head_dim)


def split_layer(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(anchor, residual) uint8 planes of one layer's K and V over a span."""
    from pdserve.engine import kvcodec  # torch: only on this path
    return kvcodec.split(torch.stack([k, v]))


def plane_sizes(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[int, int]:
    from pdserve.engine import kvcodec  # torch: only on this path
    spec = kvcodec.CodecSpec(dtype, shape)
    return spec.anchor_nbytes, spec.residual_nbytes


def plane_meta(plane: torch.Tensor) -> ObjectMeta:
    return ObjectMeta("uint8", (plane.numel(),))
