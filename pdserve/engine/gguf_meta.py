"""Fast reader for a GGUF file's header: its metadata key/values and its tensor directory.

`gguf.GGUFReader` builds a numpy view per array element, which costs ~2 s for the 49k-token
vocabulary of even a 135M model; the tokenizer and the config only need plain Python values, so
this parses the header with `struct` (~0.1 s) and never touches tensor data.
Owns the byte layout of the header (GGUF v2/v3, little-endian); must not dequantize or import torch,
so the router can tokenize without loading the model runtime. The loader memory-maps tensor data
at the offsets found here (tests check this parse against GGUFReader's).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32  # bytes; the data section and every tensor start on this boundary

# GGUF value type ids (gguf spec, `GGUFValueType`).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY = range(10)
_UINT64, _INT64, _FLOAT64 = 10, 11, 12

_SCALAR = {
    _UINT8: ("<B", 1), _INT8: ("<b", 1), _UINT16: ("<H", 2), _INT16: ("<h", 2),
    _UINT32: ("<I", 4), _INT32: ("<i", 4), _FLOAT32: ("<f", 4), _BOOL: ("<?", 1),
    _UINT64: ("<Q", 8), _INT64: ("<q", 8), _FLOAT64: ("<d", 8),
}


class GGUFFormatError(ValueError):
    """The file is not a GGUF file this reader understands; the message says why."""


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first): GGUF stores dims innermost first
    ggml_type: int  # `gguf.GGMLQuantizationType` value
    offset_bytes: int  # from the start of the tensor data section


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    metadata: dict[str, Any]  # arrays become lists
    tensors: tuple[GGUFTensorInfo, ...]
    data_offset_bytes: int  # where the tensor data section starts in the file

    def arch_value(self, key: str, default: Any = None) -> Any:
        """`{general.architecture}.{key}`, the per-architecture hyperparameter namespace."""
        arch = self.metadata.get("general.architecture", "")
        return self.metadata.get(f"{arch}.{key}", default)


class _Cursor:
    """Reads little-endian values from a bytes buffer, advancing a position."""

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def scalar(self, vtype: int) -> Any:
        fmt, size = _SCALAR[vtype]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        if self.pos > len(self.buf):
            raise EOFError
        # errors="replace": a few vocabularies hold tokens that are not valid UTF-8 on their own;
        # GGUFReader decodes them the same way.
        return self.buf[start:self.pos].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype = self.scalar(_UINT32)
            count = self.scalar(_UINT64)
            if etype in _SCALAR:  # a numeric array: one C-level unpack
                fmt, size = _SCALAR[etype]
                end = self.pos + count * size
                if end > len(self.buf):
                    raise EOFError
                values = struct.unpack_from(f"<{count}{fmt[1]}", self.buf, self.pos)
                self.pos = end
                return list(values)
            return [self.value(etype) for _ in range(count)]
        if vtype not in _SCALAR:
            raise GGUFFormatError(f"unknown GGUF value type {vtype} at byte {self.pos}")
        return self.scalar(vtype)


def read_gguf_header(path: str, *, chunk_bytes: int = 32 << 20) -> GGUFHeader:
    """Parse the metadata and tensor directory of the GGUF file at `path`.

    Reads only the header's bytes: starts with `chunk_bytes` and rereads with twice as many when a
    header (a 150k-token vocabulary is ~3 MB) does not fit.
    """
    with open(path, "rb") as f:
        size = chunk_bytes
        while True:
            f.seek(0)
            buf = f.read(size)
            try:
                return _parse(buf)
            except (EOFError, struct.error):
                if len(buf) < size:  # the whole file is in `buf`: it is cut short
                    raise GGUFFormatError(f"{path}: truncated GGUF header") from None
                size *= 2


def _parse(buf: bytes) -> GGUFHeader:
    if buf[:4] != GGUF_MAGIC:
        raise GGUFFormatError(f"not a GGUF file (magic {buf[:4]!r})")
    cur = _Cursor(buf)
    cur.pos = 4
    version = cur.scalar(_UINT32)
    if version not in (2, 3):
        # v1 used 32-bit counts; a byte-swapped version number means a big-endian file.
        raise GGUFFormatError(f"unsupported GGUF version {version} (need 2 or 3, little-endian)")
    n_tensors = cur.scalar(_UINT64)
    n_kv = cur.scalar(_UINT64)
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar(_UINT32))
    tensors = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar(_UINT32)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, cur.pos)
        cur.pos += 8 * n_dims
        ggml_type = cur.scalar(_UINT32)
        offset = cur.scalar(_UINT64)
        tensors.append(GGUFTensorInfo(name, tuple(reversed(dims)), ggml_type, offset))
    align = metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0:
        raise GGUFFormatError(f"bad general.alignment {align!r}")
    data_offset = -(-cur.pos // align) * align
    return GGUFHeader(version, metadata, tuple(tensors), data_offset)
