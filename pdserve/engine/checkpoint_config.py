"""What a checkpoint says about its model before any weight is read: its `ModelConfig`.

Owns reading a Hugging Face folder's `config.json` and a GGUF file's metadata into the one
`ModelConfig` the engine, the router and the benchmarks share. Torch-free, so a router or a
command that only needs the model's shape starts without loading torch.
Must not read weights: `loader` does.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from typing import Any

from pdserve.engine.config import ModelConfig
from pdserve.engine.gguf_meta import GGUFFormatError, GGUFHeader, read_gguf_header
from pdserve.engine.model_files import CheckpointError, ModelNotFoundError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3")


def load_model_config(path: str) -> ModelConfig:
    """The ModelConfig of a checkpoint without reading its weights (for the router)."""
    if os.path.isdir(path):
        return hf_config(path)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return gguf_config(path)
    if not os.path.exists(path):
        raise ModelNotFoundError(f"model path {path!r} does not exist")
    raise CheckpointError(f"model path {path!r} is neither a folder with config.json nor a .gguf file")


def hf_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise CheckpointError(f"{path!r} has no config.json")
    with open(cfg_path, encoding="utf-8") as f:
        return ModelConfig.from_hf_dict(json.load(f), name=os.path.basename(os.path.normpath(path)))


def config_from_gguf(meta: Mapping[str, Any], tensor_names: Collection[str],
                     name: str = "model") -> ModelConfig:
    """ModelConfig from GGUF metadata (llama.cpp keys) and the file's tensor names."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise CheckpointError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHS)})")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = get("embedding_length"), get("attention.head_count")
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens is not None else get("vocab_size")
    head_dim = meta.get(f"{arch}.attention.key_length") or meta.get(f"{arch}.rope.dimension_count")
    eos_ids = tuple(dict.fromkeys(
        meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id",
                          "tokenizer.ggml.eom_token_id") if k in meta))
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim or hidden // heads,
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(meta, arch),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=any(n.endswith(".attn_q.bias") for n in tensor_names),
        qk_norm=any(n.endswith(".attn_q_norm.weight") for n in tensor_names),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=eos_ids,
        name=name,
    )


def _gguf_rope_scaling(meta: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn" and factor:
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": float(factor)}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        return scaling
    if kind not in ("none", "linear", "yarn"):
        raise CheckpointError(f"GGUF rope scaling type {kind!r} is not supported")
    return None


def gguf_config(path: str, header: GGUFHeader | None = None) -> ModelConfig:
    if header is None:
        try:
            header = read_gguf_header(path)
        except GGUFFormatError as e:
            raise CheckpointError(f"cannot read GGUF file {path!r}: {e}") from e
    stem = os.path.basename(path)[: -len(".gguf")]
    return config_from_gguf(header.metadata, {t.name for t in header.tensors}, name=stem)
