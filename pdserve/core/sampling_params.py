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

from pdserve.core.errors import InvalidArgumentError  # noqa: F401 - re-exported
from pdserve.core.structured import StructuredOutput


MAX_LOGPROBS = 20  # most alternatives per token, as OpenAI's top_logprobs
MAX_LOGIT_BIAS = 300  # most biased tokens per request, as OpenAI's limit


def _finite_in(name: str, v: float, lo: float, hi: float, *, lo_open: bool = False) -> None:
    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
            or v < lo or v > hi or (lo_open and v == lo)):
        raise InvalidArgumentError(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], "
                                   f"got {v}")


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
    # Logits processing, with vLLM's meaning (`pdserve.engine.logits_process` applies them).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids unique
    min_p: float = 0.0
    min_tokens: int = 0
    structured_output: StructuredOutput | None = None
    # None: off; k: each prompt token's logprob (after the first) plus the top k. The prompt
    # is then computed whole: no cached prefix is taken.
    prompt_logprobs: int | None = None

    @property
    def processed(self) -> bool:
        """Whether any logits processing applies (besides a structured output's mask)."""
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_p
                    or self.min_tokens)

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
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (isinstance(k, bool) or not isinstance(k, int)
                                  or not 0 <= k <= MAX_LOGPROBS):
                raise InvalidArgumentError(name, f"must be an integer in [0, {MAX_LOGPROBS}], "
                                           f"got {k!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            _finite_in(name, getattr(self, name), -2.0, 2.0)
        _finite_in("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        _finite_in("min_p", self.min_p, 0.0, 1.0)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidArgumentError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens, got "
                                       f"{len(self.logit_bias)}")
        seen: set[int] = set()
        for t, b in self.logit_bias:
            if vocab_size is not None and not 0 <= t < vocab_size:
                raise InvalidArgumentError("logit_bias", f"token {t} is out of range")
            if t in seen:
                raise InvalidArgumentError("logit_bias", f"token {t} appears twice")
            seen.add(t)
            _finite_in(f"logit_bias[{t}]", b, -100.0, 100.0)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgumentError("min_tokens", f"must be in [0, max_tokens], got "
                                       f"{self.min_tokens}")
        if self.structured_output is not None:
            self.structured_output.validate()

    def with_seed(self) -> "SamplingParams":
        """A copy with a concrete seed, so every hop samples from the same stream."""
        if self.seed is not None or self.temperature == 0:
            return self
        return replace(self, seed=secrets.randbits(62))
