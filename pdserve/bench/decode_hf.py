"""The `transformers` side of `pdserve bench decode`: the same weights through Hugging Face.

Owns loading a checkpoint with `transformers` (GGUF or HF folder) on a device, left-padding
prompt token ids into a batch, and timing greedy `generate` and one cached prefill forward, each
between device synchronizations. Must not touch the engine: the benchmark compares the two.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from pdserve.engine.device import synchronize
from pdserve.engine.model_runner import DTYPES


def load_hf(model_path: str, dtype: str, device: str = "cpu") -> Any:
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM

    # transformers 4.56 renamed `torch_dtype` to `dtype`; older versions ignore the new name.
    key = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    kwargs = {key: DTYPES[dtype]}
    if os.path.isfile(model_path) and model_path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(
            os.path.dirname(model_path), gguf_file=os.path.basename(model_path), **kwargs)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, **kwargs)
    return model.to(device).eval()


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def hf_generate_s(model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int, pad_id: int) -> float:
    """Seconds of a greedy `generate` making exactly `n` tokens per row (prefill included)."""
    dev = str(model.device)
    ids, mask = ids.to(dev), mask.to(dev)
    with torch.inference_mode():
        synchronize(dev)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
        synchronize(dev)
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + n, (tuple(out.shape), ids.shape, n)
    return dt


def hf_prefill_s(model: Any, prompt: list[int]) -> float:
    """Seconds of one forward over the prompt with the cache on and only the last row's logits,
    which is the work `generate` does for its first token and the engine does in its step."""
    dev = str(model.device)
    ids = torch.tensor([prompt], dtype=torch.long, device=dev)
    with torch.inference_mode():
        synchronize(dev)
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
        synchronize(dev)
        return time.perf_counter() - t0


def pad_id_of(model: Any) -> int:
    gc = model.generation_config
    for cand in (gc.pad_token_id, gc.eos_token_id, 0):
        if isinstance(cand, (list, tuple)):
            cand = cand[0] if cand else None
        if cand is not None:
            return int(cand)
    return 0
