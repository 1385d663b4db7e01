"""The emulated engine: the real engine core over a runner that models time instead of computing.

Owns the emulated model: each step lasts what a step-time profile (`core/step_profile.py`, the
simulator's model) says that batch takes on the profiled hardware, measured from when the step
starts to run; its tokens are deterministic (`token_of`: a function of the request's id, its
output position and, when it samples, its seed), so a client can check that no token was lost,
repeated or reordered across retries, flips, resumes and migrations; and its KV blocks are bytes
of the profile's size per token (scaled by `kv_scale`, so that a machine's memory holds the
experiment), put to and fetched from the store as the real blocks are.

Everything else is the real code: the scheduler, the block pool and prefix cache, the request
API, the stop rules (max_tokens, stop tokens and strings), the workers around it. The tokens
are never an end-of-sequence token, so a request ends at max_tokens or a stop rule; penalties,
logit bias and min_p do not change them. Structured outputs and speculative decoding need a
model and are refused.
Must not import torch: an emulated worker stays small. A load and scale tool, like dummy
weights: every correctness test runs the real engine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import Callable

from pdserve.core.errors import ConfigError, InvalidArgumentError
from pdserve.core.sampling_params import TokenLogprobs
from pdserve.core.step_profile import StepProfile, step_work
from pdserve.engine.checkpoint_config import load_model_config
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.engine_core import EngineCore
from pdserve.engine.outputs import ModelRunnerOutput

# The router keeps a request's id unique on the workers with a suffix after this separator;
# the tokens follow the client's id, so a client can compute them.
ID_SUFFIX = "~"
FIRST_TOKEN = 100  # emulated tokens stay clear of the low ids tokenizers keep for special tokens


def token_of(request_id: str, position: int, seed: int | None, vocab_size: int,
             avoid: frozenset[int] = frozenset()) -> int:
    """The emulated token at output `position` of the request the client called `request_id`
    (the router's suffix, if any, dropped); `seed` only for a request that samples."""
    key = f"{request_id.split(ID_SUFFIX, 1)[0]}\0{position}\0{'' if seed is None else seed}"
    span = vocab_size - FIRST_TOKEN
    t = FIRST_TOKEN + int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(),
                                     "little") % span
    while t in avoid:
        t = FIRST_TOKEN + (t - FIRST_TOKEN + 1) % span
    return t


def sampling_seed(params) -> int | None:
    """The seed the emulated tokens follow: the request's, when it samples."""
    return params.seed if params.temperature > 0 else None


class EmulatedKV:
    """The KV cache as blocks of bytes: read a block, and a zero block of the emulated size
    comes out; write one, and its size is checked (the content is not kept)."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._zero = bytes(block_bytes)

    def read_block(self, block_id: int) -> bytes:
        return self._zero

    def write_block(self, block_id: int, data) -> None:
        if len(data) != self.block_bytes:
            raise ValueError(f"an emulated KV block is {self.block_bytes} bytes, got {len(data)}")

    def read_slots(self, layer: int, slots: list[int]):
        raise ConfigError("the emulated engine does not stream KV layer by layer")


class EmulatedRunner:
    """Runs a scheduled batch in the profile's time and draws deterministic tokens."""

    drafter = None
    num_speculative_tokens = 0

    def __init__(self, profile: StepProfile, model_config: ModelConfig, kv: EmulatedKV, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.profile = profile
        self.model_config = model_config
        self.kv = kv
        self.eos = frozenset(model_config.eos_token_ids)
        self.clock, self.sleep = clock, sleep
        self.on_prefill_layer = None  # (no layer-wise streaming: there are no layers)
        self.between_layers = None
        self.modelled_s = 0.0  # every step's modelled time, summed
        self.late_s = 0.0  # how far steps ran past their modelled end (this process's own cost)

    def check_structured(self, so) -> None:
        raise InvalidArgumentError("structured_output", "the emulated engine has no model to "
                                   "constrain")

    def execute(self, batch) -> ModelRunnerOutput:
        start = self.clock()
        step_s = self.profile.work_s(*step_work(batch.seqs, batch.num_new))
        sampled: list[list[int]] = []
        lps: list = []
        prompt_lps: list = []
        for i, seq in enumerate(batch.seqs):
            p = seq.params
            if not batch.samples(i):
                sampled.append([])
                lps.append(None)
                prompt_lps.append(None)
                continue
            t = token_of(seq.request_id, seq.num_output_tokens, sampling_seed(p),
                         self.model_config.vocab_size, self.eos)
            sampled.append([t])
            lps.append([TokenLogprobs(t, 0.0, [(t, 0.0)][:p.logprobs])]
                       if p.logprobs is not None else None)
            prompt_lps.append((1, [TokenLogprobs(x, 0.0, [(x, 0.0)][:p.prompt_logprobs])
                                   for x in seq.prompt_ids[1:]])
                              if p.prompt_logprobs is not None and not seq.num_output_tokens
                              else None)
        self.modelled_s += step_s
        left = start + step_s - self.clock()
        if left > 0:
            self.sleep(left)
        else:
            self.late_s -= left
        return ModelRunnerOutput(sampled, lps, prompt_lps)

    def prompt_logits(self, ids, block_table):
        raise InvalidArgumentError("prompt", "the emulated engine computes no logits")

    def stats(self) -> dict[str, int | list[int]]:
        return {}


def kv_block_bytes(profile: StepProfile, block_size: int, kv_scale: float) -> int:
    """Bytes of one emulated KV block: the profile's per token, times the block, scaled."""
    if not 0 < kv_scale <= 1:
        raise ConfigError(f"kv_scale must be in (0, 1], got {kv_scale}")
    if profile.kv_bytes_per_token <= 0:
        raise ConfigError(f"profile {profile.model!r} has no kv_bytes_per_token")
    return max(1, round(profile.kv_bytes_per_token * block_size * kv_scale))


def emulated_engine(cfg: EngineConfig, profile: StepProfile, kv_scale: float = 1.0, *,
                    model_config: ModelConfig | None = None, **runner_kw) -> EngineCore:
    """An engine for `cfg`'s model's vocabulary and shape (its config only: no weights are
    read) whose steps take `profile`'s time."""
    if cfg.spec is not None:
        raise ConfigError("the emulated engine does not speculate (no drafter to run)")
    model_config = model_config or load_model_config(cfg.model_path)
    cfg = dataclasses.replace(cfg, device="cpu", dtype="float32")
    kv = EmulatedKV(kv_block_bytes(profile, cfg.cache.block_size_tokens, kv_scale))
    runner = EmulatedRunner(profile, model_config, kv, **runner_kw)
    return EngineCore(cfg, runner, model_config, max_anchor_drafts=0)
