"""The engine of the real model: `EngineCore` over a `ModelRunner` (weights, paged KV cache,
sampler, drafter) on a resolved device and dtype. Everything else a step does is the core's
(`engine/engine_core.py`); the workers and tests use this class for the real model.
"""

from __future__ import annotations

import dataclasses

import torch

from pdserve.engine.attention import SHORT_SPAN
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.device import check_quantization, resolve_device, resolve_dtype
from pdserve.engine.engine_core import EngineCore, ParkedKV  # noqa: F401 (re-exported)
from pdserve.engine.model import LlamaModel
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import StepOutput  # noqa: F401 (re-exported for the workers)


class LLMEngine(EngineCore):
    def __init__(self, cfg: EngineConfig, *, model_config: ModelConfig | None = None,
                 weights: dict[str, torch.Tensor] | None = None, tokenizer=None) -> None:
        device = resolve_device(cfg.device)
        cfg = dataclasses.replace(cfg, device=device, dtype=resolve_dtype(cfg.dtype, device))
        check_quantization(cfg.quantization, cfg.device, cfg.dtype)  # as resolved
        max_anchor_drafts = SHORT_SPAN - 1
        runner = ModelRunner(cfg, model_config, weights, max_anchor_drafts=max_anchor_drafts,
                             tokenizer=tokenizer)
        super().__init__(cfg, runner, runner.model_config, max_anchor_drafts=max_anchor_drafts,
                         tokenizer=tokenizer)

    @property
    def model(self) -> LlamaModel:
        return self.runner.model
