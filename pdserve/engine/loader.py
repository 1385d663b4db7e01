"""Checkpoint loading: a model path in, `(ModelConfig, state dict)` out.

Owns reading Hugging Face folders (`config.json` + safetensors) and llama.cpp GGUF files, and
turning both into one naming scheme (Hugging Face Llama names) and one layout, so the model code
never knows where its weights came from. GGUF tensors are dequantized here, into the run dtype.
Must not build modules or touch devices: tensors come back on the CPU.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np
import torch

from pdserve.engine.checkpoint_config import (  # noqa: F401 - load_model_config re-exported
    SUPPORTED_ARCHS, config_from_gguf, gguf_config, hf_config, load_model_config)
from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_meta import GGUFFormatError, GGUFHeader, GGUFTensorInfo, read_gguf_header
# Re-exported: what a path says before any weight is read lives in the torch-free model_files.
from pdserve.engine.model_files import (  # noqa: F401
    CheckpointError, ModelNotFoundError, default_model_path)


class UnsupportedTensorTypeError(CheckpointError):
    """A GGUF tensor is stored in a ggml type this loader does not dequantize."""

    def __init__(self, tensor: str, type_name: str) -> None:
        super().__init__(
            f"GGUF tensor {tensor!r} has type {type_name}; supported types are "
            f"{', '.join(sorted(_SUPPORTED_GGML_TYPES))}")
        self.tensor = tensor
        self.type_name = type_name


def load_checkpoint(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Load an HF folder or a `.gguf` file; tensors are `dtype`, contiguous, on the CPU."""
    if os.path.isdir(path):
        config, state = _load_hf_folder(path, dtype)
    elif os.path.isfile(path) and path.endswith(".gguf"):
        config, state = _load_gguf(path, dtype)
    elif not os.path.exists(path):
        raise ModelNotFoundError(f"model path {path!r} does not exist")
    else:
        raise CheckpointError(
            f"model path {path!r} is neither a folder with config.json nor a .gguf file")
    check_state_dict(config, state)
    return config, state



def expected_weight_names(config: ModelConfig) -> set[str]:
    """Every tensor name a checkpoint for `config` must provide, no more, no less."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        names.add("lm_head.weight")
    per_layer = ["input_layernorm.weight", "post_attention_layernorm.weight",
                 "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
    per_layer += [f"self_attn.{p}_proj.weight" for p in "qkvo"]
    if config.attention_bias:
        per_layer += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    if config.qk_norm:
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    for i in range(config.num_hidden_layers):
        names.update(f"model.layers.{i}.{p}" for p in per_layer)
    return names


def check_state_dict(config: ModelConfig, state: Mapping[str, torch.Tensor]) -> None:
    """Raise `CheckpointError` when names do not match `config` exactly.

    A missing tensor would leave random weights; an extra one means the config misread the
    architecture (e.g. biases the model would ignore). Both must fail at load, not as bad tokens.
    """
    expected = expected_weight_names(config)
    missing, extra = sorted(expected - state.keys()), sorted(state.keys() - expected)
    if missing or extra:
        raise CheckpointError(
            f"checkpoint {config.name!r} does not match its config: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
            f"{'...' if len(extra) > 5 else ''}")


# ---- Hugging Face folders -------------------------------------------------------------------



def _load_hf_folder(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    config = hf_config(path)
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        for name, tensor in load_file(os.path.join(path, file)).items():
            # Old Llama checkpoints store the rotary table; it is recomputed from the config.
            if name.endswith("rotary_emb.inv_freq"):
                continue
            if name in state:
                raise CheckpointError(f"tensor {name!r} appears in more than one file of {path!r}")
            state[name] = tensor.to(dtype).contiguous()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return config, state


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        missing = [f for f in files if not os.path.isfile(os.path.join(path, f))]
        if missing:
            raise CheckpointError(f"{path!r}: shards named in the index are missing: {missing}")
        return files
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path!r} has no *.safetensors files")
    return files


# ---- GGUF files -------------------------------------------------------------------------------

_SUPPORTED_GGML_TYPES = frozenset({"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"})
_GGUF_TOP_LEVEL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Llama-3.1 GGUFs carry the llama3 rope as precomputed frequency factors; transformers' GGUF loader
# ignores this tensor too, and invariant 1 (same tokens as transformers) wins over llama.cpp here.
_GGUF_IGNORED = frozenset({"rope_freqs.weight"})


def gguf_to_hf_name(name: str) -> str | None:
    """The HF name for a llama.cpp tensor name, or None when the name is not a known weight."""
    if name in _GGUF_TOP_LEVEL:
        return _GGUF_TOP_LEVEL[name]
    m = _GGUF_BLOCK_RE.fullmatch(name)
    if m is None or m.group(2) not in _GGUF_BLOCK:
        return None
    return f"model.layers.{m.group(1)}.{_GGUF_BLOCK[m.group(2)]}.{m.group(3)}"



def unpermute_rotary_rows(w: Any, n_head: int) -> Any:
    """Undo llama.cpp's q/k row permutation for llama-architecture GGUFs.

    HF Llama rotates the two halves of each head (`rotate_half`); llama.cpp rotates adjacent pairs,
    so its converter reorders each head's rows from [half0 | half1] to interleaved pairs:
    `w.reshape(n_head, 2, d/2, ...).swapaxes(1, 2)`. The inverse swaps the other two axes. This is
    transformers' `LlamaTensorProcessor._reverse_permute_weights`; it works on 1-D biases too,
    and on numpy arrays and torch tensors alike.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)





def _ggml_type(info: GGUFTensorInfo) -> Any:
    from gguf import GGMLQuantizationType

    try:
        kind = GGMLQuantizationType(info.ggml_type)
    except ValueError:
        raise UnsupportedTensorTypeError(info.name, f"ggml type id {info.ggml_type}") from None
    if kind.name not in _SUPPORTED_GGML_TYPES:
        raise UnsupportedTensorTypeError(info.name, kind.name)
    return kind


def _tensor_values(mm: np.ndarray, base: int, info: GGUFTensorInfo) -> np.ndarray | torch.Tensor:
    """float32 numpy values of one tensor (BF16: a bfloat16 torch tensor, exact), read from the
    memory-mapped file `mm`; the result may alias `mm` (the caller copies)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize, quant_shape_to_byte_shape

    kind = _ggml_type(info)
    block, type_bytes = GGML_QUANT_SIZES[kind]
    n_bytes = int(np.prod(info.shape)) * type_bytes // block
    start = base + info.offset_bytes
    if start + n_bytes > mm.size:
        raise CheckpointError(f"GGUF tensor {info.name!r} runs past the end of the file (truncated?)")
    raw = mm[start:start + n_bytes]
    if kind == GGMLQuantizationType.F32:
        return raw.view(np.float32).reshape(info.shape)
    if kind == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(info.shape).astype(np.float32)
    if kind == GGMLQuantizationType.BF16:
        return torch.from_numpy(raw.view(np.int16).reshape(info.shape).copy()).view(torch.bfloat16)
    blocks = raw.reshape(quant_shape_to_byte_shape(info.shape, kind))
    return dequantize(blocks, kind).reshape(info.shape)


def _load_gguf(path: str, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    # Tensor data is memory-mapped at the offsets of our own header parse rather than through
    # gguf.GGUFReader: the reader builds a numpy view per vocabulary string, which was 2-4 s of a
    # 4-5 s load of the 135M model; this path loads it in ~1-2 s.
    try:
        header = read_gguf_header(path)
    except GGUFFormatError as e:
        raise CheckpointError(f"cannot read GGUF file {path!r}: {e}") from e
    config = gguf_config(path, header)
    # llama.cpp permutes q/k only when converting llama-architecture models (Llama, Mistral,
    # SmolLM); Qwen2/3 use HF's rotate_half layout in ggml too and are stored as is.
    permute_heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads} \
        if config.architecture == "llama" else {}
    for info in header.tensors:  # fail before dequantizing anything
        _ggml_type(info)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    state: dict[str, torch.Tensor] = {}
    for info in header.tensors:
        hf_name = gguf_to_hf_name(info.name)
        if hf_name is None:
            if info.name in _GGUF_IGNORED:
                continue
            raise CheckpointError(f"GGUF tensor {info.name!r} in {path!r} has no known HF name")
        values = _tensor_values(mm, header.data_offset_bytes, info)
        kind = info.name.split(".")[2] if info.name.startswith("blk.") else ""
        if kind in permute_heads:
            values = unpermute_rotary_rows(values, permute_heads[kind])
        if isinstance(values, np.ndarray):
            # np.array copies: the result must not alias the read-only memory map of the file.
            values = torch.from_numpy(np.array(values, dtype=np.float32, order="C"))
        state[hf_name] = values.to(dtype).contiguous()
    return config, state
