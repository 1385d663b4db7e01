"""Step-time profiles: how long one engine step, one KV transfer, one role flip takes.

Owns `StepProfile` (a frozen record of fitted or derived constants, with its origin), its JSON
form, and the shipped profiles under `profiles/` (`load_profile("h100-llama3-8b")`).

One step's time is a roofline with a fixed cost:

    step_s = overhead_s + [prefill_fixed_s if prefill] + [decode_fixed_s if decode]
             + max(compute_s, memory_s)
    compute_s = prefill_token_s * uncached tokens + prefill_attn_s * attended (query, key) pairs
                + decode_seq_s * decode sequences + decode_ctx_s * decode context tokens
    memory_s  = weights_read_s (once per step) + kv_read_token_s * context tokens read

plus, in a step with decodes, what serving them costs beyond the engine's step (a worker streams
each sequence's token out, on the cores the step runs on): serve_step_s + serve_seq_s * decode
sequences; and in a step with prefill tokens, what serving a prefill costs beyond the engine's
step (each layer's KV streamed out while the next computes, the first token's way back):
serve_prefill_step_s + serve_prefill_token_s * prefill tokens. A CPU profile measures both on a
real cluster (`simtools/calibrate.py`); a GPU profile leaves them zero.

A profile measured on a CPU fits the compute terms (memory terms zero: there the step is linear
in its work); a GPU profile from `roofline.py` sets both from FLOPs and bytes. Transfers are
`latency + bytes / bandwidth` per transport, uncontended (the simulator shares links).

A profile measured on CPU cores that several workers share says so: `host_cores` (the host's
cores, None where each worker owns its accelerator), `threads_per_worker` (the compute threads one
step uses) and, where measured, `host_slowdown` (how many times longer a step takes with 1, 2,
... such workers computing at once) and `host_slowdown_decode` (the same for one decode step
beside 0, 1, ... computing prefills); `host.py` turns them into a step's stretch.

Must not import torch or the engine, or model contention between transfers.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import math
from dataclasses import dataclass
from pathlib import Path

from pdserve.core.errors import ConfigError

SHIPPED = ("cpu-smollm2-135m", "h100-llama3-8b", "h200-llama3-8b", "a100-llama2-7b",
           "h100-llama2-7b")


# The terms of a step's time (the formula above) and a flip's: what `slowed` scales.
STEP_TERMS = ("overhead_s", "prefill_fixed_s", "decode_fixed_s", "prefill_token_s",
              "prefill_attn_s", "decode_seq_s", "decode_ctx_s", "weights_read_s",
              "kv_read_token_s", "serve_step_s", "serve_seq_s", "serve_prefill_step_s",
              "serve_prefill_token_s", "flip_s")


class ProfileError(ConfigError):
    """A profile field is missing or invalid; the message names the field."""


@dataclass(frozen=True)
class TransportLink:
    """One transport's uncontended cost: a fixed latency per transfer and a bandwidth."""

    latency_s: float
    bytes_per_s: float


@dataclass(frozen=True)
class StepProfile:
    """Constants of one (hardware, model) pair; see the module docstring for the step formula."""

    origin: str
    model: str
    overhead_s: float = 0.0
    prefill_fixed_s: float = 0.0
    decode_fixed_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_attn_s: float = 0.0
    decode_seq_s: float = 0.0
    decode_ctx_s: float = 0.0
    weights_read_s: float = 0.0
    kv_read_token_s: float = 0.0
    serve_step_s: float = 0.0  # serving a decode step beyond the engine's: per step
    serve_seq_s: float = 0.0  # and per decode sequence
    serve_prefill_step_s: float = 0.0  # serving a prefill beyond the engine's step: per step
    serve_prefill_token_s: float = 0.0  # and per prefill token
    transports: dict[str, TransportLink] = dataclasses.field(default_factory=dict)
    kv_bytes_per_token: int = 0
    flip_s: float = 0.0
    startup_s: float = 0.0
    kv_capacity_tokens: int = 0
    host_cores: int | None = None  # cores the workers of one host share (None: own device)
    threads_per_worker: int = 1
    host_slowdown: tuple[float, ...] = ()  # step-time factor with 1, 2, ... workers busy
    host_slowdown_decode: tuple[float, ...] = ()  # a decode step's, beside computing prefills
    fit: dict = dataclasses.field(default_factory=dict)  # how it was made: points, errors

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("float", "int"):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ProfileError(f"{f.name} must be a number, got {value!r}")
                if not math.isfinite(value) or value < 0:
                    raise ProfileError(f"{f.name} must be finite and >= 0, got {value!r}")
        def whole(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool) and x >= 1
        if self.host_cores is not None and not whole(self.host_cores):
            raise ProfileError(f"host_cores must be an integer >= 1 or null, got "
                               f"{self.host_cores!r}")
        if not whole(self.threads_per_worker):
            raise ProfileError(f"threads_per_worker must be an integer >= 1, got "
                               f"{self.threads_per_worker!r}")
        for name in ("host_slowdown", "host_slowdown_decode"):
            table = getattr(self, name)
            if not isinstance(table, (list, tuple)) or not all(
                    not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
                    and x > 0 for x in table):
                raise ProfileError(f"{name} must be a list of numbers > 0, got {table!r}")
            object.__setattr__(self, name, tuple(float(x) for x in table))
        if not self.origin:
            raise ProfileError("origin must say where the profile comes from")
        for name, link in self.transports.items():
            if link.bytes_per_s <= 0 or link.latency_s < 0:
                raise ProfileError(f"transports.{name} needs bytes_per_s > 0 and latency_s >= 0")

    # -- step times -----------------------------------------------------------------------
    def step_s(self, *, prefill_tokens: int = 0, attn_pairs: float = 0.0, decode_batch: int = 0,
               decode_ctx: int = 0, kv_read_tokens: int = 0) -> float:
        """One step carrying this work (the general form behind the three shortcuts)."""
        compute = (self.prefill_token_s * prefill_tokens + self.prefill_attn_s * attn_pairs
                   + self.decode_seq_s * decode_batch + self.decode_ctx_s * decode_ctx)
        memory = self.weights_read_s + self.kv_read_token_s * kv_read_tokens
        fixed = self.overhead_s
        if prefill_tokens > 0:
            fixed += (self.prefill_fixed_s + self.serve_prefill_step_s
                      + self.serve_prefill_token_s * prefill_tokens)
        if decode_batch > 0:
            fixed += self.decode_fixed_s + self.serve_step_s + self.serve_seq_s * decode_batch
        return fixed + max(compute, memory)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        """A prefill chunk of `new_tokens` uncached tokens on top of `cached_tokens` of context"""
        if new_tokens < 0 or cached_tokens < 0:  # (checked so: called for every step)
            _check_counts(new_tokens=new_tokens, cached_tokens=cached_tokens)
        if new_tokens == 0:
            return 0.0
        return self.step_s(prefill_tokens=new_tokens,
                           attn_pairs=attn_pairs(new_tokens, cached_tokens),
                           kv_read_tokens=cached_tokens + new_tokens)

    def decode_s(self, batch: int, context_tokens: int) -> float:
        """One decode step of `batch` sequences holding `context_tokens` tokens in total."""
        if batch < 0 or context_tokens < 0:
            _check_counts(batch=batch, context_tokens=context_tokens)
        if batch == 0:
            return 0.0
        return self.step_s(decode_batch=batch, decode_ctx=context_tokens,
                           kv_read_tokens=context_tokens)

    def mixed_s(self, prefill_tokens: int, decode_batch: int, context_tokens: int,
                prefill_cached_tokens: int = 0) -> float:
        """One step carrying a prefill chunk and a decode batch (`context_tokens`: the decodes')."""
        if min(prefill_tokens, decode_batch, context_tokens, prefill_cached_tokens) < 0:
            _check_counts(prefill_tokens=prefill_tokens, decode_batch=decode_batch,
                          context_tokens=context_tokens,
                          prefill_cached_tokens=prefill_cached_tokens)
        if prefill_tokens == 0 and decode_batch == 0:
            return 0.0
        return self.step_s(prefill_tokens=prefill_tokens,
                           attn_pairs=attn_pairs(prefill_tokens, prefill_cached_tokens),
                           decode_batch=decode_batch, decode_ctx=context_tokens,
                           kv_read_tokens=context_tokens + prefill_cached_tokens + prefill_tokens)

    def work_s(self, prefill_tokens: int, decode_batch: int, context_tokens: int,
               cached_tokens: int, pairs: float) -> float:
        """One step carrying `step_work`'s sizes (attention pairs per sequence: a batch of
        prompts is not one long prompt)."""
        if prefill_tokens:
            return self.step_s(prefill_tokens=prefill_tokens, attn_pairs=pairs,
                               decode_batch=decode_batch, decode_ctx=context_tokens,
                               kv_read_tokens=context_tokens + cached_tokens + prefill_tokens)
        return self.decode_s(decode_batch, context_tokens)

    def transfer_s(self, nbytes: int, transport: str) -> float:
        """Uncontended time to move `nbytes` over `transport` (one of `self.transports`)."""
        if nbytes < 0:
            _check_counts(nbytes=nbytes)
        link = self.transports.get(transport)
        if link is None:
            raise ProfileError(f"transport {transport!r} is not in this profile "
                               f"(it has: {', '.join(sorted(self.transports)) or 'none'})")
        return link.latency_s + nbytes / link.bytes_per_s

    # -- JSON -----------------------------------------------------------------------------
    def slowed(self, factor: float) -> StepProfile:
        """The same engine `factor` times slower: every step term (and a flip) scaled, the
        transfers, KV sizes and capacity as they are. A large cluster of emulated workers
        running this can be loaded by fewer arrivals per second than the profile's own."""
        if not (math.isfinite(factor) and factor > 0):
            raise ProfileError(f"a slowdown must be a number > 0, got {factor!r}")
        if factor == 1:
            return self
        return dataclasses.replace(
            self, **{name: getattr(self, name) * factor for name in STEP_TERMS},
            origin=f"{self.origin}; every step x{factor:g}")

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["transports"] = {k: dataclasses.asdict(v) for k, v in sorted(self.transports.items())}
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, d: dict) -> StepProfile:
        if not isinstance(d, dict):
            raise ProfileError(f"a profile is a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ProfileError(f"unknown profile field(s): {', '.join(unknown)}")
        for required in ("origin", "model"):
            if required not in d:
                raise ProfileError(f"{required} is missing")
        kw = dict(d)
        links = kw.get("transports", {})
        if not isinstance(links, dict):
            raise ProfileError("transports must be an object of name -> {latency_s, bytes_per_s}")
        try:
            kw["transports"] = {name: TransportLink(float(v["latency_s"]), float(v["bytes_per_s"]))
                                for name, v in links.items()}
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"transports: each needs latency_s and bytes_per_s ({e})") from e
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> StepProfile:
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ProfileError(f"a profile must be JSON: {e}") from e
        return cls.from_dict(d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())


def attn_pairs(new_tokens: int, cached_tokens: int) -> float:
    """(query, key) pairs a causal prefill of `new_tokens` on `cached_tokens` attends over."""
    return new_tokens * cached_tokens + new_tokens * (new_tokens + 1) / 2


def step_work(seqs, num_new) -> tuple[int, int, int, int, float]:
    """What a scheduled step carries, as `work_s` reads it: (prefill tokens, decode sequences,
    their context tokens, the prefilling sequences' cached tokens, attention pairs). An entry
    decodes when it runs one token past its prompt, its own last; any other entry prefills."""
    prefill = decode = ctx = cached = 0
    pairs = 0.0
    for seq, n in zip(seqs, num_new):
        done = seq.num_computed
        if n == 1 and done >= seq.prompt_len and done + 1 >= len(seq.token_ids):
            decode += 1
            ctx += done
        else:
            prefill += n
            cached += done
            pairs += attn_pairs(n, done)
    return prefill, decode, ctx, cached, pairs


def _check_counts(**counts: int) -> None:
    for name, n in counts.items():
        if n < 0:
            raise ProfileError(f"{name} must be >= 0, got {n}")


def shipped_path(name: str):
    return importlib.resources.files("pdserve.core") / "profiles" / f"{name}.json"


def load_profile(path_or_name: str | Path) -> StepProfile:
    """A shipped profile by name (see `SHIPPED`) or a profile JSON file by path."""
    key = str(path_or_name)
    if key in SHIPPED:
        return StepProfile.from_json(shipped_path(key).read_text())
    path = Path(key)
    if not path.is_file():
        raise ProfileError(f"profile {key!r} is neither a file nor a shipped profile "
                           f"({', '.join(SHIPPED)})")
    return StepProfile.from_json(path.read_text())
