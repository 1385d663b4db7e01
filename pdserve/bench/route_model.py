"""The model `pdserve bench route` serves unless given one: a small random Llama, built locally.

Routing is measured by where prompt tokens are computed, not by what the model says, so the
weights are random (seeded). The size is chosen for 2 CPU cores: a prefill of a few hundred
tokens takes milliseconds, so a replay of a thousand trace requests per policy takes about a
minute, while prefill compute still dominates a request (cache hits show in TTFT). The
tokenizer is SmolLM2's (from the default GGUF), so the folder is a complete HF model that the
router and workers load like any other. Must not download anything.
"""

from __future__ import annotations

import json
import os

import torch

VOCAB = 49152  # SmolLM2's tokenizer


def build_bench_model(path: str, *, hidden: int = 256, layers: int = 4, heads: int = 4,
                      kv_heads: int = 2, intermediate: int = 768,
                      max_positions: int = 8192) -> str:
    """Write config.json, model.safetensors and SmolLM2's tokenizer into `path`; return it."""
    from safetensors.torch import save_file

    from pdserve.engine.loader import default_model_path
    from pdserve.engine.tokenizer import Tokenizer

    os.makedirs(path, exist_ok=True)
    tok = Tokenizer.from_path(default_model_path())
    eos = tok.eos_token_ids[0]
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB,
              "hidden_size": hidden, "intermediate_size": intermediate,
              "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": max_positions,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
              "bos_token_id": tok.bos_token_id, "eos_token_id": eos}
    head_dim = hidden // heads
    g = torch.Generator().manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.02

    state = {"model.embed_tokens.weight": rand(VOCAB, hidden),
             "model.norm.weight": torch.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        state.update({
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(intermediate, hidden),
            p + "mlp.up_proj.weight": rand(intermediate, hidden),
            p + "mlp.down_proj.weight": rand(hidden, intermediate)})
    save_file(state, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=1)
    tok.backend.save(os.path.join(path, "tokenizer.json"))
    specials = {"eos_token": tok.backend.id_to_token(eos)}
    if tok.bos_token_id is not None:
        specials["bos_token"] = tok.backend.id_to_token(tok.bos_token_id)
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(specials, f, indent=1)
    return path
