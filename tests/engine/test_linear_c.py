"""The C linear kernel for fp32 on CPU against `F.linear`, and the choice of path in `Linear`."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import linear_cpu
from pdserve.engine.linear import Linear, c_kernel_available

pytestmark = pytest.mark.skipif(not linear_cpu.available(),
                                reason=f"no C linear kernel: {linear_cpu.unavailable_reason()}")


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m, n, k", [(1, 48, 16), (3, 50, 7), (8, 96, 576), (9, 960, 576),
                                     (17, 47, 33), (33, 200, 1536), (130, 144, 64),
                                     (12, 72, 200)])
def test_matches_f_linear(m, n, k, threads):
    """Every row count (full tiles of 8 rows with AVX-512, 4 with AVX2, and the rest), a partial
    last panel (N not a multiple of the panel width), odd K, one and two threads: fp32 within
    summation-order rounding."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) / k ** 0.5
    x = torch.randn(m, k, generator=g)
    b = torch.randn(n, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = linear_cpu.linear(x, linear_cpu.pack(w), n, b)
    finally:
        torch.set_num_threads(before)
    want = F.linear(x.double(), w.double(), b.double()).float()
    assert got.shape == (m, n)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_does_not_depend_on_the_batch_it_is_in(threads):
    """Each output is one FMA chain over k in order, however the rows are tiled and k is
    sliced: a request's logits are bit for bit the same alone and in a batch."""
    g = torch.Generator().manual_seed(threads)
    w = torch.randn(200, 1000, generator=g) / 1000 ** 0.5
    x = torch.randn(70, 1000, generator=g)
    packed = linear_cpu.pack(w)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        alone = torch.cat([linear_cpu.linear(x[i:i + 1], packed, 200) for i in range(70)])
        for m in (5, 12, 33, 70):
            assert torch.equal(linear_cpu.linear(x[:m], packed, 200), alone[:m])
    finally:
        torch.set_num_threads(before)


def test_the_panel_width_follows_the_instruction_set():
    assert (linear_cpu.isa(), linear_cpu.panel_width()) in (("avx512f", 48), ("avx2", 24))
    assert linear_cpu.pack(torch.randn(50, 7)).shape == (-(-50 // linear_cpu.panel_width()), 7,
                                                         linear_cpu.panel_width())


def test_linear_takes_any_leading_shape_and_strides(monkeypatch):
    monkeypatch.setenv("PDSERVE_LINEAR", "c")
    w = torch.randn(100, 64)
    lin = Linear(w)
    assert lin.kind == "c" and lin.packed
    x = torch.randn(4, 3, 128)[..., ::2]  # [4, 3, 64], not contiguous
    torch.testing.assert_close(lin(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert lin(torch.empty(0, 64)).shape == (0, 100)


def test_the_path_follows_dtype_device_and_the_override(monkeypatch):
    w = torch.randn(32, 16)
    monkeypatch.delenv("PDSERVE_LINEAR", raising=False)
    assert c_kernel_available(torch.float32, torch.device("cpu"))  # the default where it runs
    assert Linear(w).kind == "c"
    monkeypatch.setenv("PDSERVE_LINEAR", "auto")
    assert Linear(w).kind == "c"
    monkeypatch.setenv("PDSERVE_LINEAR", "c")
    assert Linear(w).kind == "c"
    assert c_kernel_available(torch.float32, torch.device("cpu"))
    assert not c_kernel_available(torch.bfloat16, torch.device("cpu"))
    assert not c_kernel_available(torch.float32, torch.device("cuda"))
    assert Linear(w, pack=False).kind == "plain"
    monkeypatch.setenv("PDSERVE_LINEAR", "reference")
    assert Linear(w).kind == "plain"
    monkeypatch.setenv("PDSERVE_LINEAR", "onednn")
    assert Linear(w).kind in ("onednn", "plain")  # oneDNN where this torch has it
    x = torch.randn(5, 16)
    for mode in ("onednn", "reference", "c"):
        monkeypatch.setenv("PDSERVE_LINEAR", mode)
        torch.testing.assert_close(Linear(w)(x), F.linear(x, w), rtol=1e-5, atol=1e-5)
