"""int8 weight-only linear layers: the kernel's product, the engine in int8 mode, the guards.

The kernel must equal x . (Q * s)^T (the dequantized weight) up to fp32 rounding, on every
instruction set this CPU has, for shapes that leave partial panels, partial k slices and
partial row tiles. The engine in int8 mode must follow fp32's greedy tokens most of the way
(what it costs is measured by `pdserve bench quant`, not asserted here), and int8 with a GPU or
a dtype other than float32 must fail naming the field. Speed is never asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from pdserve.core.errors import ConfigError
from pdserve.engine import linear_int8
from pdserve.engine.config import CacheConfig, EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.linear import Linear
from pdserve.engine.sampling import SamplingParams

needs_kernel = pytest.mark.skipif(not linear_int8.available(),
                                  reason=f"{linear_int8.unavailable_reason()}")


def _isas() -> list[str]:
    if not linear_int8.available():
        return []
    return ["avx2", "avx512f"] if linear_int8.isa() == "avx512f" else ["avx2"]


def _close(y: torch.Tensor, ref: torch.Tensor) -> None:
    err = (y - ref).abs().max().item()
    assert err <= 1e-5 * ref.abs().max().item(), err


def test_quantize_is_symmetric_per_row_and_round_trips_within_half_a_step():
    torch.manual_seed(0)
    w = torch.randn(37, 70)
    w[5] = 0.0  # an all-zero row: scale 0, values 0
    q, s = linear_int8.quantize(w)
    assert q.dtype == torch.int8 and s.shape == (37,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert s[5] == 0 and not q[5].any()
    back = linear_int8.dequantize(q, s)
    assert ((back - w).abs() <= s[:, None] / 2 + 1e-7).all()


@needs_kernel
@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (3, 50, 130), (9, 100, 300), (33, 49, 257),
                                   (32, 1536, 576)])
def test_kernel_equals_the_dequantized_reference(isa, m, n, k):
    torch.manual_seed(m * n + k)
    w, x, bias = torch.randn(n, k), torch.randn(m, k), torch.randn(n)
    packed = linear_int8.pack(w, isa)
    q, s = linear_int8.unpack(packed)
    assert torch.equal(q, linear_int8.quantize(w)[0])
    ref = x @ linear_int8.dequantize(q, s).T + bias
    for threads in (1, 2):
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _close(linear_int8.linear(x, packed, bias), ref)
        finally:
            torch.set_num_threads(old)
    assert linear_int8.linear(x[:0], packed).shape == (0, n)


@needs_kernel
@pytest.mark.parametrize("isa", _isas())
def test_a_rows_result_does_not_depend_on_its_batch(isa):
    """One row alone (one pass over k) and in a batch of 33 (k in slices, partial sums kept in
    the output) give the same bits: speculative verification and plain decode batch rows
    differently, and int8 greedy must not depend on that."""
    torch.manual_seed(2)
    w, x = torch.randn(100, 300), torch.randn(33, 300)
    packed = linear_int8.pack(w, isa)
    batch = linear_int8.linear(x, packed)
    for i in (0, 8, 32):
        assert torch.equal(linear_int8.linear(x[i:i + 1], packed)[0], batch[i])


def test_torch_fallback_computes_the_same_product():
    torch.manual_seed(1)
    w, x = torch.randn(40, 64), torch.randn(5, 64)
    q, s = linear_int8.quantize(w)
    unpacked = linear_int8.PackedInt8(q, s, 40, 0)  # what pack() gives without the kernel
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "much slower": said once per process
        y = linear_int8.linear(x, unpacked)
    _close(y, x @ linear_int8.dequantize(q, s).T)


def test_linear_keeps_fp32_paths_and_refuses_int8_outside_cpu_fp32():
    w = torch.randn(48, 32)
    assert Linear(w).kind != "int8"
    lin = Linear(w, quantization="int8")
    assert lin.kind == "int8" and lin.nbytes < w.numel() * 4 // 3
    with pytest.raises(ValueError, match="fp32 weight on the CPU"):
        Linear(w.to(torch.bfloat16), quantization="int8")
    with pytest.raises(ValueError, match="quantization"):
        Linear(w, quantization="int4")


# ---- the guards ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,words", [
    (dict(device="cuda"), "--quantization int8 runs on the CPU only"),
    (dict(device="cuda:1"), "--device cuda:1"),
    (dict(dtype="bfloat16"), "--quantization int8 needs --dtype float32"),
    (dict(quantization="int4"), "--quantization must be one of none, int8"),
])
def test_bad_combinations_fail_naming_the_field(kw, words):
    from pdserve.bench.decode import DecodeBenchSettings
    from pdserve.launcher.cluster_spec import ClusterSpec
    from pdserve.worker.config import WorkerConfig

    kw = {"quantization": "int8", **kw}
    for make in (lambda: EngineConfig("m", **kw), lambda: WorkerConfig("m", **kw),
                 lambda: ClusterSpec("m", **kw), lambda: DecodeBenchSettings(**kw)):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(")) as e:
            make()
        assert "quantization" in str(e.value)
    EngineConfig("m", quantization="int8", dtype="auto", device="cpu")  # auto is fp32 on CPU


def test_serve_refuses_int8_with_a_gpu_dtype_before_starting_anything():
    from pdserve.cli import build_parser
    from pdserve.cli_serve import input_problem

    args = build_parser().parse_args(["serve", "--quantization", "int8", "--dtype", "bfloat16"])
    assert "--quantization int8 needs --dtype float32" in input_problem(args)
    args = build_parser().parse_args(["serve", "--quantization", "int8", "--device", "cpu"])
    assert input_problem(args) is None


def test_int8_blocks_have_their_own_model_id():
    from pdserve.worker.server import model_id_for

    assert model_id_for("/m/x.gguf", "float32") == "x.gguf@float32"
    assert model_id_for("/m/x.gguf", "float32", quantization="int8") == "x.gguf@float32+int8"


# ---- the engine on the real model ---------------------------------------------------------------
QUESTIONS = ("What is the capital of France?", "Write a Python function that reverses a string.")
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def engines(smollm2_gguf_path):
    def make(q: str) -> LLMEngine:
        return LLMEngine(EngineConfig(smollm2_gguf_path, quantization=q,
                                      cache=CacheConfig(block_size_tokens=16, num_blocks=64)))
    return make("none"), make("int8")


@pytest.fixture(scope="module")
def chat_prompts(smollm2_gguf_path):
    from pdserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_gguf_path)
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                       add_special_tokens=False) for q in QUESTIONS]


@needs_kernel
def test_int8_engine_follows_fp32_greedy(engines, chat_prompts):
    from pdserve.bench.quant import first_divergence, teacher_forced

    ref, quant = engines
    assert quant.model.layers[0]["qkv"].kind == "int8" and ref.model.layers[0]["qkv"].kind != "int8"
    assert quant.model.weight_bytes() < 0.5 * ref.model.weight_bytes()
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    want, got = ref.generate(chat_prompts, params), quant.generate(chat_prompts, params)
    assert [len(g) for g in got] == [NEW_TOKENS] * len(QUESTIONS)
    # Measured: both follow fp32 for all of 64 tokens (the sky question of the oracle set
    # diverges after 16, so it is not used); a wrong scale or panel layout diverges at once.
    prefix = [first_divergence(w, g) for w, g in zip(want, got)]
    assert all(n >= 24 for n in prefix), prefix
    tf = [teacher_forced(ref, quant, p, w) for p, w in zip(chat_prompts, want)]
    top1 = [t for d in tf for t in d["top1"]]
    assert sum(top1) / len(top1) >= 0.9  # measured 1.0
    assert max(k for d in tf for k in d["kl"]) < 0.1  # measured 0.014


def test_without_a_compiler_int8_says_why_and_runs_on_the_fallback(tmp_path):
    """No C compiler: the kernel is unavailable with the compiler named, and an int8 layer
    still computes the dequantized product through the torch fallback, with a warning."""
    import os
    import subprocess
    import sys

    code = (
        "import warnings, torch\n"
        "from pdserve.engine import linear_int8\n"
        "from pdserve.engine.linear import Linear\n"
        "assert not linear_int8.available()\n"
        "print(linear_int8.unavailable_reason())\n"
        "torch.manual_seed(0); w, x = torch.randn(24, 40), torch.randn(3, 40)\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    y = Linear(w, quantization='int8')(x)\n"
        "q, s = linear_int8.quantize(w)\n"
        "ref = x @ linear_int8.dequantize(q, s).T\n"
        "assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), (y - ref).abs().max()\n"
        "assert any('much slower' in str(m.message) for m in seen)\n")
    env = {**os.environ, "CC": "/nonexistent-cc", "PDSERVE_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "C compiler '/nonexistent-cc' not found" in out.stdout
