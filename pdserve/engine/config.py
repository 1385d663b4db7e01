"""Model and engine configuration: frozen dataclasses, validated at the boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.core.errors import ConfigError  # noqa: F401 (re-exported: the workers' import path)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3, Qwen2, Qwen3, SmolLM).

    Field names follow Hugging Face `config.json` so an HF config maps one to one.
    """

    architecture: str  # "llama", "qwen2", "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # HF `rope_scaling` dict (e.g. {"rope_type": "llama3", "factor": 8.0, ...}) or None.
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has q/k/v biases
    qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim",
                  "max_position_embeddings"):
            if getattr(self, f) <= 0:
                raise ConfigError(f"{f} must be positive, got {getattr(self, f)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")

    @staticmethod
    def from_hf_dict(cfg: dict[str, Any], name: str = "model") -> "ModelConfig":
        arch = cfg.get("model_type", "llama")
        if arch not in ("llama", "qwen2", "qwen3", "mistral"):
            raise ConfigError(f"model_type {arch!r} is not a supported Llama-family architecture")
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta, rope_scaling = _hf_rope(cfg)
        return ModelConfig(
            architecture="llama" if arch == "mistral" else arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            qk_norm=arch == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either config.json spelling.

    transformers < 5 writes top-level `rope_theta` and `rope_scaling`; transformers 5 writes one
    `rope_parameters` dict holding `rope_theta` and `rope_type` (plus the scaling fields), and no
    `rope_scaling`, so reading only the old keys would silently drop Llama-3 scaling.
    """
    params = cfg.get("rope_parameters") or {}
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        scaling = dict(scaling)
        if "rope_type" not in scaling and "type" in scaling:  # the pre-4.45 key name
            scaling["rope_type"] = scaling["type"]
        if scaling.get("rope_type", "default") == "default":
            scaling = None
    return float(theta), scaling


@dataclass(frozen=True)
class CacheConfig:
    block_size_tokens: int = 16
    num_blocks: int = 2048
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size_tokens <= 0 or self.num_blocks <= 0:
            raise ConfigError("block_size_tokens and num_blocks must be positive")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decode tokens)
    max_waiting: int = 1024  # bounded queue: past it add_request raises QueueFullError

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0 or self.max_waiting <= 0:
            raise ConfigError("scheduler limits must be positive")


SPEC_METHODS = ("ngram", "eagle", "dflash", "dspark")


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding on this engine's decode steps (greedy and sampled requests)."""

    method: str = "ngram"  # "ngram", or a trained drafter: "eagle", "dflash", "dspark"
    num_speculative_tokens: int = 4  # most draft tokens per request per step (gamma)
    ngram_min: int = 1  # n-gram drafter: shortest match tried
    ngram_max: int = 3  # n-gram drafter: longest match tried (tried first)
    draft_path: str | None = None  # trained drafter directory (safetensors + config.json)
    # Confidence scheduling: cut each request's draft to the prefix that maximises expected
    # tokens per unit of step time, from a step-cost table profiled per batch size.
    schedule: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"spec.method must be one of {', '.join(SPEC_METHODS)}, "
                              f"got {self.method!r}")
        if self.num_speculative_tokens <= 0:
            raise ConfigError("spec.num_speculative_tokens must be positive")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError("spec.ngram_min and ngram_max need 1 <= ngram_min <= ngram_max")
        if self.method != "ngram" and not self.draft_path:
            raise ConfigError(f"spec.draft_path is required for spec.method {self.method!r}")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    # "auto": the device's default (bfloat16 on a GPU, float32 on the CPU; engine.device).
    dtype: str = "float32"
    # "cpu", "cuda", "cuda:N" (within CUDA_VISIBLE_DEVICES) or "auto" (a GPU when there is one);
    # the engine resolves it once and keeps the resolved value in its own cfg.
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_model_len_tokens: int | None = None  # defaults to the model's context length
    spec: SpecConfig | None = None  # speculative decoding; None: off
    # "none", or "int8": projection weights quantized per output channel, CPU and float32 only
    # (opt-in; `pdserve bench quant` measures what it costs in accuracy).
    quantization: str = "none"

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got "
                              f"{self.dtype!r}")
        from pdserve.engine.device import check_quantization, parse_device

        parse_device(self.device)  # a bad value raises here, naming --device
        check_quantization(self.quantization, self.device, self.dtype)
