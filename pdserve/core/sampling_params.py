"""Sampling parameters, validated at the boundary, and the types every hop shares about them.

Owns what a request asks of the sampler (`SamplingParams` and its validation, naming the bad
field), the field error every service maps to INVALID_ARGUMENT / HTTP 400, and the per-token
log-probability record. Torch-free: the router validates and forwards these without loading
torch.
Must not sample: `pdserve.engine.sampling` turns logits into tokens.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field, replace


class InvalidArgumentError(ValueError):
    """A request field is invalid. `field` names it (mapped to INVALID_ARGUMENT / HTTP 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name
        self.message = message


MAX_LOGPROBS = 20  # most alternatives per token, as OpenAI's top_logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the `k` most likely tokens (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token id, logprob)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    seed: int | None = None
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: the sampled token's logprob plus the top k

    def validate(self, *, max_model_len: int | None = None, prompt_len: int | None = None,
                 vocab_size: int | None = None) -> None:
        if (not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature)
                or self.temperature < 0):
            raise InvalidArgumentError("temperature",
                                       f"must be finite and >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidArgumentError("top_k", f"must be >= 0, got {self.top_k}")
        if self.max_tokens <= 0:
            raise InvalidArgumentError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if max_model_len is not None:
            if self.max_tokens > max_model_len:
                raise InvalidArgumentError(
                    "max_tokens", f"{self.max_tokens} exceeds the context length {max_model_len}")
            if prompt_len is not None and prompt_len + self.max_tokens > max_model_len:
                raise InvalidArgumentError(
                    "max_tokens", f"prompt ({prompt_len} tokens) plus max_tokens "
                    f"({self.max_tokens}) exceeds the context length {max_model_len}")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not 0 <= t < vocab_size:
                    raise InvalidArgumentError("stop_token_ids", f"token {t} is out of range")
        for s in self.stop:
            if not s:
                raise InvalidArgumentError("stop", "stop strings must be non-empty")
        if self.logprobs is not None and (isinstance(self.logprobs, bool)
                                          or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidArgumentError("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], "
                                       f"got {self.logprobs!r}")

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed, so every hop samples from the same stream."""
        if self.seed is not None or self.temperature == 0:
            return self
        return replace(self, seed=secrets.randbits(62))
