"""The anchor/residual KV codec rebuilds every bit pattern exactly (invariant 3), its Triton kernels
and C loops write the same bytes as the PyTorch reference, and the anchor alone is within the
documented bounds.

Inputs are bit patterns, not floats: per value either arbitrary bits (NaN payloads, infinities,
signed zeros, subnormals all appear), a value a few binades under a per-example base exponent
(the normal-mode groups real KV makes, near the 7 and 37 binade limits), or a listed special.
The Triton kernels run on CPU under TRITON_INTERPRET=1, set below before triton decorates them.
The C backend is compiled on first use (into $PDSERVE_CACHE or ~/.cache/pdserve); its tests skip
where no C compiler is found.
"""

from __future__ import annotations

import importlib
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pdserve.engine import kvcodec, kvcodec_cpu
from pdserve.engine.kvcodec import CodecSpec, KVCodecError, anchor_fraction, dequantize_anchor, join, split

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # triton.jit reads it when the kernels are decorated
pytest.importorskip("triton")
if "pdserve.engine.kvcodec_triton" in sys.modules:  # decorated earlier, maybe without the variable
    importlib.reload(sys.modules["pdserve.engine.kvcodec_triton"])
from pdserve.engine import kvcodec_triton  # noqa: E402,F401  (imported here: after the variable)

# dtype -> (bits, mantissa bits, numpy unsigned and signed views)
LAYOUT = {torch.float32: (32, 23, np.uint32, np.int32), torch.bfloat16: (16, 7, np.uint16, np.int16),
          torch.float16: (16, 10, np.uint16, np.int16)}
DTYPES = list(LAYOUT)
INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
BACKENDS = ["torch", "triton", "c"]
needs_c = pytest.mark.skipif(not kvcodec_cpu.available(), reason="kvcodec C backend: no C compiler")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def specials(dtype: torch.dtype) -> list[int]:
    """+0, -0, subnormals, normal extremes, +-inf, quiet/signalling NaNs with payloads."""
    w, m, _, _ = LAYOUT[dtype]
    sign, exp_all, top = 1 << (w - 1), ((1 << (w - 1 - m)) - 1) << m, 1 << (m - 1)
    return [0, sign, 1, sign | 1, (1 << m) - 1, 1 << m, exp_all - 1, exp_all, sign | exp_all,
            exp_all | top, exp_all | 1, sign | exp_all | top | 5, exp_all | (1 << m) - 1,
            (127 if w == 32 or dtype == torch.bfloat16 else 15) << m]  # 1.0


@st.composite
def patterns(draw, dtype: torch.dtype) -> list[int]:
    w, m, _, _ = LAYOUT[dtype]
    base = draw(st.integers(0, (1 << (w - 1 - m)) - 2))
    near = st.builds(lambda s, off, mant: (s << (w - 1)) | (max(base - off, 0) << m) | mant,
                     st.integers(0, 1), st.integers(0, 40), st.integers(0, (1 << m) - 1))
    tiny = st.sampled_from(specials(dtype)[:5])  # signed zeros and subnormals
    if draw(st.booleans()):  # mostly normal-mode groups, as real KV makes
        elem = st.one_of(near, tiny)
    else:
        elem = st.one_of(near, st.integers(0, (1 << w) - 1), st.sampled_from(specials(dtype)))
    n = draw(st.integers(1, 300))
    return draw(st.lists(elem, min_size=n, max_size=n))


def as_tensor(bits: list[int], dtype: torch.dtype) -> torch.Tensor:
    _, _, unsigned, signed = LAYOUT[dtype]
    return torch.from_numpy(np.array(bits, dtype=unsigned).view(signed).copy()).view(dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(INT_VIEW[a.dtype]), b.contiguous().view(INT_VIEW[b.dtype]))


def roundtrip(x: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "c" and not kvcodec_cpu.available():
        pytest.skip("kvcodec C backend: no C compiler")
    anchor, residual = split(x, backend=backend)
    spec = CodecSpec.for_tensor(x)
    assert anchor.dtype == residual.dtype == torch.uint8 and anchor.is_contiguous()
    assert (anchor.numel(), residual.numel()) == (spec.anchor_nbytes, spec.residual_nbytes)
    assert same_bytes(join(anchor, residual, x.dtype, x.shape, backend=backend), x)
    return anchor, residual


# ---- exact reconstruction

@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
@settings(max_examples=60, **SETTINGS)
def test_reference_roundtrip_is_exact(dtype, data):
    roundtrip(as_tensor(data.draw(patterns(dtype)), dtype), "torch")


@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
@settings(max_examples=15, **SETTINGS)
def test_triton_matches_reference_bytes(dtype, data):
    x = as_tensor(data.draw(patterns(dtype)), dtype)
    ref = split(x, backend="torch")
    tri = roundtrip(x, "triton")
    assert torch.equal(ref[0], tri[0]) and torch.equal(ref[1], tri[1])
    assert same_bytes(dequantize_anchor(ref[0], dtype, x.shape, backend="triton"),
                      dequantize_anchor(ref[0], dtype, x.shape, backend="torch"))


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
@settings(max_examples=80, **SETTINGS)
def test_c_matches_reference_bytes(dtype, data):
    x = as_tensor(data.draw(patterns(dtype)), dtype)
    ref = split(x, backend="torch")
    got = roundtrip(x, "c")
    assert torch.equal(ref[0], got[0]) and torch.equal(ref[1], got[1])
    assert same_bytes(dequantize_anchor(ref[0], dtype, x.shape, backend="c"),
                      dequantize_anchor(ref[0], dtype, x.shape, backend="torch"))


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
@given(data=st.data())
@settings(max_examples=40, **SETTINGS)
def test_c_follows_reference_on_arbitrary_planes(dtype, data):
    """Planes no split wrote (any header, delta and ext): C join and dequantize give the reference's bytes."""
    n = data.draw(st.integers(1, 200))
    spec = CodecSpec(dtype, (n,))
    headers = st.sampled_from([0, 1, 3, 6, 7, 8, 37, 100, 200, 254, 255]) | st.integers(0, 255)
    anchor = torch.tensor(data.draw(st.lists(headers, min_size=spec.num_groups, max_size=spec.num_groups))
                          + data.draw(st.lists(st.integers(0, 255), min_size=n, max_size=n)), dtype=torch.uint8)
    residual = torch.tensor(data.draw(st.lists(st.integers(0, 255), min_size=spec.residual_nbytes,
                                               max_size=spec.residual_nbytes)), dtype=torch.uint8)
    assert same_bytes(join(anchor, residual, dtype, (n,), backend="c"),
                      join(anchor, residual, dtype, (n,), backend="torch"))
    assert same_bytes(dequantize_anchor(anchor, dtype, (n,), backend="c"),
                      dequantize_anchor(anchor, dtype, (n,), backend="torch"))


@needs_c
@pytest.mark.parametrize("dtype", DTYPES)
def test_c_large_tensor_in_threaded_chunks(dtype):
    """Chunks cut at group boundaries (threads=2) write the reference's bytes; a tail group included."""
    w, m, unsigned, signed = LAYOUT[dtype]
    rng = np.random.default_rng(5)
    n = (1 << 21) + 17  # above the chunking threshold, not a multiple of 32
    x = torch.from_numpy((rng.standard_normal(n) * 0.3).astype(np.float32)).to(dtype)
    bits = x.view(INT_VIEW[dtype])
    hit = torch.from_numpy(rng.choice(n, 2000, replace=False))  # raw groups and odd values, scattered
    bits[hit] = torch.from_numpy(rng.integers(0, 1 << w, 2000, dtype=np.uint64).astype(unsigned).view(signed))
    ref = split(x, backend="torch")
    for threads in (1, 2, 5):
        a, r = kvcodec_cpu.split(x, threads=threads)
        assert torch.equal(a, ref[0]) and torch.equal(r, ref[1])
        assert same_bytes(kvcodec_cpu.join(a, r, dtype, x.shape, threads=threads), x)
    want = dequantize_anchor(ref[0], dtype, x.shape, backend="torch")
    assert same_bytes(kvcodec_cpu.dequantize_anchor(ref[0], dtype, x.shape, threads=2), want)
    # Into the caller's buffers (reused across calls on a hot path): same bytes, the buffers returned.
    planes = (torch.full_like(ref[0], 7), torch.full_like(ref[1], 7))
    got = kvcodec_cpu.split(x, threads=2, out=planes)
    assert got[0] is planes[0] and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    buf = torch.empty_like(x)
    assert kvcodec_cpu.join(*ref, dtype, x.shape, out=buf).data_ptr() == buf.data_ptr() and same_bytes(buf, x)
    assert same_bytes(kvcodec_cpu.dequantize_anchor(ref[0], dtype, x.shape, out=buf), want)
    with pytest.raises(ValueError, match="out"):
        kvcodec_cpu.split(x, out=(planes[0][1:], planes[1]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_specials_alone_and_among_normal_values(dtype, backend):
    sp = specials(dtype)
    one = 1 << LAYOUT[dtype][1]  # the smallest normal
    normal = [v * 3 + one * 40 for v in range(40)]  # a normal-mode run, then the specials mixed in
    x = as_tensor(sp + normal + sp[::-1] + normal[:7] + [sp[0]] * 33, dtype)
    roundtrip(x, backend)
    for v in sp:  # each special alone, padded to a group and not
        roundtrip(as_tensor([v], dtype), backend)
        roundtrip(as_tensor([v] * 32 + [0], dtype), backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (1,), (31,), (33,), (3, 5, 7), (2, 2, 16, 2, 8)])
def test_shapes(dtype, backend, shape):
    # (2, 2, 16, 2, 8): a KV block, [layers, k/v, block_size, kv_heads, head_dim].
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.5).to(dtype)
    roundtrip(x, backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_block_realistic_values_and_non_contiguous_input(dtype):
    g = torch.Generator().manual_seed(0)
    scale = torch.logspace(-2, 1, 8).view(1, 1, 1, 8, 1)  # a per-head scale, 3 decades
    x = (torch.randn(4, 2, 16, 8, 64, generator=g) * scale).to(dtype)
    ref = roundtrip(x, "torch")
    roundtrip(x.transpose(2, 3), "torch")  # split copies it contiguous; join gives the same bytes
    if kvcodec_cpu.available():
        for y in (x, x.transpose(2, 3)):
            want = split(y.contiguous(), backend="torch")
            got = roundtrip(y, "c")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        assert same_bytes(dequantize_anchor(ref[0], dtype, x.shape, backend="c"),
                          dequantize_anchor(ref[0], dtype, x.shape, backend="torch"))
    if dtype != torch.float16:  # real KV fits normal mode
        assert (split(x, backend="torch")[0][:CodecSpec.for_tensor(x).num_groups] != 255).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_group_mode_boundaries(dtype, backend):
    """A gap of 37 binades (or a subnormal) stays normal mode; 38, inf or NaN makes the group raw."""
    m = LAYOUT[dtype][1]
    top, sub = 100 << m, 5  # a normal value at exponent 100; a subnormal
    cases = {(100 - 37) << m: 100, (100 - 38) << m: 255, sub: 100, 0: 100, 255 << m: 255,
             (255 << m) | 1: 255, (100 - 7) << m: 100}
    for other, header in cases.items():
        x = as_tensor([top] * 31 + [other], dtype)
        anchor, _ = roundtrip(x, backend)
        assert anchor[0].item() == header, hex(other)


# ---- the anchor alone

def _group_max_abs(x: torch.Tensor) -> torch.Tensor:
    v = x.double().abs().reshape(-1)
    v = torch.nn.functional.pad(v, (0, -v.numel() % 32))
    return v.view(-1, 32).amax(1).repeat_interleave(32)[: x.numel()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(data=st.data())
@settings(max_examples=60, **SETTINGS)
@example(data=None)  # realistic values, below
def test_anchor_error_bounds_grouped(dtype, data):
    if data is None:
        x = (torch.randn(999, generator=torch.Generator().manual_seed(1)) * 0.1).to(dtype)
    else:
        x = as_tensor(data.draw(patterns(dtype)), dtype)
    anchor, _ = split(x, backend="torch")
    ngroups = CodecSpec.for_tensor(x).num_groups
    deq = dequantize_anchor(anchor, dtype, x.shape, backend="torch").double()
    xs = x.double()
    raw = (anchor[:ngroups].repeat_interleave(32)[: x.numel()] == 255)
    a = anchor[ngroups:].to(torch.int32)
    near = ~raw & ((a >> 4) & 7 < 7) & torch.isfinite(xs) & (xs.abs() >= torch.finfo(dtype).tiny)
    far = ~raw & ((a >> 4) & 7 == 7)
    # Within 7 binades of the group max: |err| <= 2^-5 |x| (4 mantissa bits + half an ulp).
    assert ((deq - xs).abs()[near] <= 2.0 ** -5 * xs.abs()[near]).all()
    # 7 or more binades down: a signed zero, so |err| = |x| < 2^-6 * the group's max |x|.
    assert (deq[far] == 0).all() and (xs.abs()[far] < 2.0 ** -6 * _group_max_abs(x)[far]).all()
    assert (torch.signbit(deq[~raw]) == torch.signbit(xs[~raw])).all()
    # Raw groups: sign and the top 7 exponent bits, so finite values are within a factor 2.
    hi7 = a & 0x7F
    mid = raw & (hi7 > 0) & (hi7 < 0x7F) & torch.isfinite(xs)
    ratio = deq[mid] / xs[mid]
    assert ((ratio > 0.5) & (ratio <= 2)).all()


@given(data=st.data())
@settings(max_examples=60, **SETTINGS)
def test_fp16_anchor_is_e5m2_and_within_bound(data):
    x = as_tensor(data.draw(patterns(torch.float16)), torch.float16)
    anchor, _ = split(x, backend="torch")
    e5m2 = anchor.view(torch.float8_e5m2).to(torch.float16)
    truncated = (x.view(torch.int16) & ~0xFF).view(torch.float16)  # high byte, low byte zeroed
    ok = torch.isnan(truncated)
    assert ok.equal(torch.isnan(e5m2)) and same_bytes(e5m2[~ok], truncated[~ok])
    deq, xs = dequantize_anchor(anchor, torch.float16, x.shape).double(), x.double()
    normal = torch.isfinite(xs) & (xs.abs() >= torch.finfo(torch.float16).tiny)
    assert ((deq - xs).abs()[normal] <= 2.0 ** -3 * xs.abs()[normal]).all()  # 2 bits + half an ulp
    assert same_bytes(deq[~normal & ~torch.isnan(xs)].half(), truncated[~normal & ~torch.isnan(xs)])


def test_anchor_fractions():
    assert anchor_fraction(torch.float16) == 0.5
    assert anchor_fraction(torch.bfloat16) == pytest.approx(0.515625)
    assert anchor_fraction(torch.float32) == pytest.approx(0.2578125)
    for dtype in DTYPES:
        spec = CodecSpec(dtype, (1 << 20,))
        original = spec.numel * dtype.itemsize
        assert spec.anchor_nbytes / original == pytest.approx(anchor_fraction(dtype), rel=1e-6)
        assert (spec.anchor_nbytes + spec.residual_nbytes) / original <= 1.016
        x = torch.zeros(1000, dtype=dtype)  # a measured one: planes are the sizes the spec says
        assert split(x)[0].numel() == CodecSpec.for_tensor(x).anchor_nbytes


# ---- the spec and bad input

def test_spec_header_roundtrip_and_checks():
    for spec in [CodecSpec(torch.bfloat16, (2, 2, 16, 8, 64)), CodecSpec(torch.float32, ()),
                 CodecSpec(torch.float16, (0, 3))]:
        assert CodecSpec.from_bytes(spec.to_bytes()) == spec
    bad_version = bytearray(CodecSpec(torch.float32, (4,)).to_bytes())
    bad_version[0] = 9
    with pytest.raises(KVCodecError, match="version"):
        CodecSpec.from_bytes(bytes(bad_version))
    with pytest.raises(KVCodecError, match="dtype"):
        split(torch.zeros(3, dtype=torch.float64))
    anchor, residual = split(torch.ones(40, dtype=torch.float32))
    with pytest.raises(KVCodecError, match="residual"):
        join(anchor, residual[:-1], torch.float32, (40,))
    with pytest.raises(KVCodecError, match="anchor"):
        dequantize_anchor(anchor, torch.float32, (41,))
    with pytest.raises(KVCodecError, match="backend"):
        split(torch.ones(2), backend="cuda")
    assert kvcodec._pick("auto", torch.device("cpu")) == ("c" if kvcodec_cpu.available() else "torch")
    with pytest.raises(KVCodecError, match="CPU"):
        split(torch.ones(2, device="meta"), backend="c")
    assert math.prod(()) == CodecSpec(torch.float32, ()).numel == 1


# ---- the C backend's build and the backend choice

def test_auto_falls_back_to_torch_without_a_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(kvcodec_cpu, "_lib", None)
    monkeypatch.setattr(kvcodec_cpu, "_error", None)
    assert not kvcodec_cpu.available()
    with pytest.raises(kvcodec_cpu.KernelUnavailable, match="no-such-cc.*not found"):
        split(torch.ones(40), backend="c")
    assert kvcodec._pick("auto", torch.device("cpu")) == "torch"
    x = torch.randn(100)
    anchor, residual = split(x)  # auto: the reference
    assert torch.equal(anchor, split(x, backend="torch")[0])
    assert same_bytes(join(anchor, residual, x.dtype, x.shape), x)


def test_c_build_is_cached_by_source_and_atomic(monkeypatch, tmp_path):
    if not kvcodec_cpu.available():
        pytest.skip("kvcodec C backend: no C compiler")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    path = kvcodec_cpu.library_path()
    assert path.parent == tmp_path / "kvcodec" and not path.exists()
    edited = tmp_path / "kvcodec_c.c"  # an edit to the source gets a library of its own
    edited.write_text(kvcodec_cpu.SOURCE.read_text() + "\n/* edited */\n")
    monkeypatch.setattr(kvcodec_cpu, "SOURCE", edited)
    assert kvcodec_cpu.library_path() != path
    monkeypatch.undo()
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    # Two builders at once (threads here; processes do the same): each compiles to a temp name and
    # os.replace()s it, so the library is whole whichever lands last, and no temp file is left.
    errors = []
    builders = [threading.Thread(target=lambda: errors.append(kvcodec_cpu._build(path))) for _ in range(2)]
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    assert errors == [None, None] and sorted(os.listdir(path.parent)) == [path.name]
    probe = ("import ctypes, sys; sys.exit(ctypes.CDLL(sys.argv[1]).kvc_abi() != %d)" % kvcodec_cpu.ABI)
    assert subprocess.run([sys.executable, "-c", probe, str(path)]).returncode == 0
