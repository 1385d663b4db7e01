"""The anchor/residual KV codec: split a KV tensor into two byte planes for progressive transfer.

Owns the byte format (see docs/kvcodec.md) and its PyTorch reference: `split` turns a float32,
bfloat16 or float16 tensor into an *anchor* plane (high-order information, sent first) and a
*residual* plane (the rest); `join` rebuilds the original bytes exactly for every bit pattern
(invariant 3); `dequantize_anchor` gives a usable approximation from the anchor alone, for drafting
before the residual lands. The Triton kernels in `kvcodec_triton` (CUDA) and the C loops in
`kvcodec_cpu` (CPU, compiled on first use) produce the same bytes; `backend="auto"` picks Triton
for CUDA tensors, C for CPU tensors when it builds, else this reference.
It must not know where the planes go (store, transport) or what the tensor means (K or V, layer).

Format version 1, by dtype (n = numel, G = 32, groups = ceil(n / G), the tail group padded with +0):
- float16: anchor = the high byte of each value (exactly FP8 E5M2), residual = the low byte.
- bfloat16 / float32: anchor = [groups header bytes][n value bytes]; residual = 1 (bf16) or 3
  (fp32) byte planes of n bytes each, low byte plane first. A header byte is the group's shared
  exponent E (max biased exponent) in normal mode, or 255 in raw mode. Normal mode, per value:
  anchor = sign | min(E - e, 7) << 4 | top 4 mantissa bits; residual word = ext << R | low R
  mantissa bits (R = 3 / 19), ext = E - 7 - e when E - e >= 7 (0..30), 31 for e == 0 (zero or
  subnormal), 0 when E - e < 7. A group is raw when E == 255 (inf/NaN) or some nonzero-exponent
  value sits more than 37 binades below E; then anchor = the high byte, residual = the low bytes.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch

FORMAT_VERSION = 1
GROUP_SIZE = 32
RAW_HEADER = 255  # a header byte that says "raw group"; never a normal-mode E (E == 255 is raw)
MAX_DELTA = 7  # deltas d = E - e of 7 or more take their exponent from the residual's ext field
ZERO_EXT = 31  # the ext code for e == 0 (zeros and subnormals)
MAX_GAP = MAX_DELTA + ZERO_EXT - 1  # 37: the widest E - e (e > 0) a normal group can code

# dtype -> (total bits W, mantissa bits M, residual bytes per value)
_LAYOUT = {torch.float32: (32, 23, 3), torch.bfloat16: (16, 7, 1), torch.float16: (16, 10, 1)}
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_DTYPE_CODES = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 3}
_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


class KVCodecError(ValueError):
    """A tensor, plane or header the codec cannot take (wrong dtype, size, version)."""


@dataclass(frozen=True)
class CodecSpec:
    """What travels with the planes: enough to check them and rebuild the tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    group_size: int = GROUP_SIZE
    version: int = FORMAT_VERSION

    @classmethod
    def for_tensor(cls, x: torch.Tensor) -> CodecSpec:
        _check_dtype(x.dtype)
        return cls(x.dtype, tuple(x.shape))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def num_groups(self) -> int:
        return 0 if self.dtype == torch.float16 else -(-self.numel // self.group_size)

    @property
    def anchor_nbytes(self) -> int:
        return self.num_groups + self.numel

    @property
    def residual_nbytes(self) -> int:
        return _LAYOUT[self.dtype][2] * self.numel

    def to_bytes(self) -> bytes:
        """Little-endian: version u8, dtype code u8, group size u16, ndim u8, then dims as u64."""
        return struct.pack(f"<BBHB{len(self.shape)}Q", self.version, _DTYPE_CODES[self.dtype],
                           self.group_size, len(self.shape), *self.shape)

    @classmethod
    def from_bytes(cls, data: bytes) -> CodecSpec:
        if len(data) < 5:
            raise KVCodecError(f"codec header: {len(data)} bytes, need at least 5")
        version, code, group, ndim = struct.unpack_from("<BBHB", data)
        if len(data) != 5 + 8 * ndim:
            raise KVCodecError(f"codec header: {len(data)} bytes for ndim={ndim}")
        dtypes = {v: k for k, v in _DTYPE_CODES.items()}
        if code not in dtypes:
            raise KVCodecError(f"codec header: unknown dtype code {code}")
        spec = cls(dtypes[code], struct.unpack_from(f"<{ndim}Q", data, 5), group, version)
        spec.validate()
        return spec

    def validate(self) -> None:
        _check_dtype(self.dtype)
        if self.version != FORMAT_VERSION:
            raise KVCodecError(f"codec version {self.version}, this build reads {FORMAT_VERSION}")
        if self.group_size != GROUP_SIZE:
            raise KVCodecError(f"group_size {self.group_size}, format {FORMAT_VERSION} uses {GROUP_SIZE}")

    def check_planes(self, anchor: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        self.validate()
        for name, plane, want in (("anchor", anchor, self.anchor_nbytes),
                                  ("residual", residual, self.residual_nbytes)):
            if plane is None:
                continue
            if plane.dtype != torch.uint8 or plane.dim() != 1:
                raise KVCodecError(f"{name}: want a 1-d uint8 tensor, got {plane.dtype} {tuple(plane.shape)}")
            if plane.numel() != want:
                raise KVCodecError(f"{name}: {plane.numel()} bytes, {self} needs {want}")


def anchor_fraction(dtype: torch.dtype) -> float:
    """Anchor bytes / original bytes for a large tensor (header bytes included)."""
    _check_dtype(dtype)
    width_bytes = _LAYOUT[dtype][0] // 8
    if dtype == torch.float16:
        return 1 / width_bytes
    return (1 + 1 / GROUP_SIZE) / width_bytes


def split(x: torch.Tensor, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """x -> (anchor, residual): contiguous 1-d uint8 planes on x's device (sizes: `CodecSpec`)."""
    _check_dtype(x.dtype)
    x = x.contiguous()
    chosen = _pick(backend, x.device)
    if chosen == "triton":
        from pdserve.engine import kvcodec_triton
        return kvcodec_triton.split(x)
    if chosen == "c":
        from pdserve.engine import kvcodec_cpu
        return kvcodec_cpu.split(x)
    return _split_torch(x)


def join(anchor: torch.Tensor, residual: torch.Tensor, dtype: torch.dtype,
         shape: tuple[int, ...] | torch.Size, backend: str = "auto") -> torch.Tensor:
    """Rebuild the tensor `split` was given, bit for bit."""
    spec = CodecSpec(dtype, tuple(shape))
    spec.check_planes(anchor, residual)
    anchor, residual = anchor.contiguous(), residual.contiguous()
    chosen = _pick(backend, anchor.device)
    if chosen == "triton":
        from pdserve.engine import kvcodec_triton
        return kvcodec_triton.join(anchor, residual, dtype, spec.shape)
    if chosen == "c":
        from pdserve.engine import kvcodec_cpu
        return kvcodec_cpu.join(anchor, residual, dtype, spec.shape)
    return _join_torch(anchor, residual, dtype, spec.shape)


def dequantize_anchor(anchor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | torch.Size,
                      backend: str = "auto") -> torch.Tensor:
    """An approximation of the tensor from its anchor plane alone (error bounds: docs/kvcodec.md)."""
    spec = CodecSpec(dtype, tuple(shape))
    spec.check_planes(anchor)
    anchor = anchor.contiguous()
    chosen = _pick(backend, anchor.device)
    if chosen == "triton":
        from pdserve.engine import kvcodec_triton
        return kvcodec_triton.dequantize_anchor(anchor, dtype, spec.shape)
    if chosen == "c":
        from pdserve.engine import kvcodec_cpu
        return kvcodec_cpu.dequantize_anchor(anchor, dtype, spec.shape)
    return _dequantize_torch(anchor, dtype, spec.shape)


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _LAYOUT:
        raise KVCodecError(f"dtype {dtype}: the codec takes {', '.join(_DTYPE_NAMES.values())}")


def _pick(backend: str, device: torch.device) -> str:
    """auto: Triton for CUDA tensors; C for CPU tensors when it builds (else the reference)."""
    if backend == "auto":
        if device.type == "cuda" and torch.cuda.is_available():
            return "triton"
        if device.type == "cpu":
            from pdserve.engine import kvcodec_cpu
            if kvcodec_cpu.available():
                return "c"
        return "torch"
    if backend not in ("torch", "triton", "c"):
        raise KVCodecError(f"backend {backend!r}: want 'torch', 'triton', 'c' or 'auto'")
    if backend == "c" and device.type != "cpu":
        raise KVCodecError(f"backend 'c' takes CPU tensors, got {device}")
    return backend


# ---- PyTorch reference. Bits live in int32 (fp32: the raw pattern, sign bit included; 16-bit
# dtypes: zero-extended), so every right shift is followed by a mask; left shifts wrap, which puts
# an anchor's sign (0x80) in bit 31 of an fp32 pattern. Raw groups are rare in real KV, so their
# path runs only on the groups that need it.

def _bits(x: torch.Tensor) -> torch.Tensor:
    b = x.reshape(-1).view(_INT_VIEW[x.dtype]).to(torch.int32)
    return b if x.dtype == torch.float32 else b & 0xFFFF


def _from_bits(bits: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    # int32 -> int16 narrowing keeps the low 16 bits (two's complement), which is the pattern.
    return bits.to(_INT_VIEW[dtype]).view(dtype).reshape(shape)


def _grouped(v: torch.Tensor, n: int) -> torch.Tensor:
    """[n] -> [groups, G] int32, the tail padded with zeros (for bits: +0.0)."""
    return torch.nn.functional.pad(v.to(torch.int32), (0, -n % GROUP_SIZE)).view(-1, GROUP_SIZE)


def _split_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.numel()
    width, mbits, rbytes = _LAYOUT[x.dtype]
    bits = _bits(x)
    if x.dtype == torch.float16:
        return ((bits >> 8) & 0xFF).to(torch.uint8), (bits & 0xFF).to(torch.uint8)
    rbits = mbits - 4
    g = _grouped(bits, n)
    e = (g >> mbits) & 0xFF
    big_e = e.amax(dim=1, keepdim=True) if n else e[:, :1]
    d = big_e - e
    a = ((g >> (width - 8)) & 0x80) | (d.clamp(max=MAX_DELTA) << 4) | ((g >> rbits) & 0xF)
    ext = torch.where((e == 0) & (d >= MAX_DELTA), ZERO_EXT, (d - MAX_DELTA).clamp(min=0))
    r = (ext << rbits) | (g & ((1 << rbits) - 1))
    header = big_e.squeeze(1)
    gap = torch.where(e > 0, d, 0).amax(dim=1) if n else header
    raw = (header == RAW_HEADER) | (gap > MAX_GAP)
    if raw.any():
        rows = raw.nonzero().squeeze(1)
        a[rows] = (g[rows] >> (width - 8)) & 0xFF
        r[rows] = g[rows] & ((1 << (width - 8)) - 1)
        header = torch.where(raw, RAW_HEADER, header)
    r = r.view(-1)[:n]
    anchor = torch.cat([header.to(torch.uint8), a.view(-1)[:n].to(torch.uint8)])
    return anchor, torch.cat([((r >> (8 * k)) & 0xFF).to(torch.uint8) for k in range(rbytes)])


def _join_torch(anchor: torch.Tensor, residual: torch.Tensor, dtype: torch.dtype,
                shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    width, mbits, rbytes = _LAYOUT[dtype]
    if dtype == torch.float16:
        return _from_bits((anchor.to(torch.int32) << 8) | residual.to(torch.int32), dtype, shape)
    rbits = mbits - 4
    ngroups = anchor.numel() - n
    header = anchor[:ngroups].to(torch.int32).unsqueeze(1)
    a = _grouped(anchor[ngroups:], n)
    planes = residual.view(rbytes, n)
    r = _grouped(planes[0], n)
    for k in range(1, rbytes):
        r |= _grouped(planes[k], n) << (8 * k)
    ext = r >> rbits  # 0 unless the anchor's delta is 7
    e = torch.where(ext == ZERO_EXT, 0, header - ((a >> 4) & 7) - ext)
    bits = ((a & 0x80) << (width - 8)) | (e << mbits) | ((a & 0xF) << rbits) | (r & ((1 << rbits) - 1))
    raw = header.squeeze(1) == RAW_HEADER
    if raw.any():
        rows = raw.nonzero().squeeze(1)
        bits[rows] = (a[rows] << (width - 8)) | r[rows]
    return _from_bits(bits.view(-1)[:n], dtype, shape)


def _dequantize_torch(anchor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = math.prod(shape)
    width, mbits, _ = _LAYOUT[dtype]
    if dtype == torch.float16:
        a = anchor.to(torch.int32)
        exp5 = (a >> 2) & 0x1F
        # Midpoint of the dropped byte for finite nonzero exponents; zeros, subnormals, inf and
        # NaN keep the truncated pattern (so 0 stays 0 and inf stays inf).
        mid = torch.where((exp5 > 0) & (exp5 < 0x1F), 0x80, 0)
        return _from_bits((a << 8) | mid, dtype, shape)
    rbits = mbits - 4
    ngroups = anchor.numel() - n
    header = anchor[:ngroups].to(torch.int32).unsqueeze(1)
    a = _grouped(anchor[ngroups:], n)
    sign = (a & 0x80) << (width - 8)
    dc = (a >> 4) & 7
    e = header - dc
    # Normal mode: the midpoint of the kept bits' ulp; e == 0 (subnormals) truncated; d >= 7 -> +-0.
    mid = (e > 0).to(torch.int32) << (rbits - 1)
    bits = torch.where(dc < MAX_DELTA, sign | (e.clamp(min=0) << mbits) | ((a & 0xF) << rbits) | mid, sign)
    raw = header.squeeze(1) == RAW_HEADER
    if raw.any():
        # Raw mode: the high byte holds sign and the top 7 exponent bits; set the lowest exponent
        # bit (a value within a factor 2); 0 -> +-0 and all ones -> +-inf.
        rows = raw.nonzero().squeeze(1)
        ar, sr = a[rows], sign[rows]
        hi7 = ar & 0x7F
        bits[rows] = torch.where(hi7 == 0, sr, torch.where(hi7 == 0x7F, sr | (0xFF << mbits),
                                                           (ar << (width - 8)) | (1 << mbits)))
    return _from_bits(bits.view(-1)[:n], dtype, shape)
