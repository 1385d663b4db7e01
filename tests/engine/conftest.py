"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import make_tiny_hf_model


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny matmuls: on two shared cores OpenMP threads spinning against other processes make
    each step far slower than one thread. Modules opt in with
    `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def repeaty_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Llama (tied embeddings, small init) whose greedy output repeats, so drafters and
    n-gram lookups are often right."""
    return make_tiny_hf_model(tmp_path_factory.mktemp("tiny_llama_repeaty"), "llama",
                              tie_word_embeddings=True, initializer_range=0.1)
