"""`pdserve bench decode`: engine decode and prefill speed vs `transformers` and the bandwidth bound.

Owns one benchmark run, all on this machine in one process and on one device (`--device`):
engine decode tokens/s per batch size (with `--attention-baseline` also with the PyTorch
reference decode attention instead of the C kernel; with `--linear-baseline` a second engine
with oneDNN's linear layers instead of the C one; alternating which goes first), Hugging Face
`generate` on the same weights and the same prompt token ids, the memory-bandwidth bound (a
large tensor copy in that device's memory; on a GPU also the data sheet's HBM bandwidth over
weight + KV bytes per step), and one long prefill on both sides; then the ratios, a table, a
JSON document and a plot. Decode time on the `transformers` side is `generate(N + 1) -
generate(1)` (both include the same prefill), so both sides time exactly `N` decode steps per
sequence. On a GPU every timer read follows a device synchronize.
It drives `LLMEngine` through its public API only, and reports the aims; it must not assert them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.core.errors import ConfigError as BenchConfigError  # bad setting: names it
from pdserve.bench.common import number_list, threads_problem, torch_threads
from pdserve.output import emit
from pdserve.engine.attention import describe_decode_path
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.device import (DeviceError, check_quantization, device_name, resolve_device,
                                   resolve_dtype, synchronize)
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import DTYPES
from pdserve.engine.sampling import SamplingParams
from pdserve.bench.decode_hf import (hf_generate_s, hf_prefill_s, left_pad,  # noqa: F401
                                     load_hf, pad_id_of)
from pdserve.bench.decode_report import print_table, summarize, write_outputs

BLOCK_SIZE_TOKENS = 16
PROMPT_SEED = 0


@dataclass(frozen=True)
class DecodeBenchSettings:
    """What one run measures; validated here so a bad CLI value fails before any model loads."""

    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: int = 128
    new_tokens: int = 64
    prefill_tokens: int = 2048
    dtype: str = "float32"
    repeats: int = 3
    device: str = "cpu"  # resolved ("cpu" or "cuda:N"): engine, transformers and copy all run there
    copy_bytes: int = 512 << 20
    # Also time the engine with the PyTorch reference decode attention (PDSERVE_PAGED_ATTN=torch)
    # right after each engine run: the C kernel's gain, measured in the same run.
    attention_baseline: bool = False
    linear_baseline: bool = False
    quantization: str = "none"  # the engine's (`EngineConfig.quantization`); int8: CPU, fp32

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            raise BenchConfigError(f"batch_sizes must be positive, got {self.batch_sizes}")
        for name in ("prompt_tokens", "new_tokens", "prefill_tokens", "repeats", "copy_bytes"):
            if getattr(self, name) <= 0:
                raise BenchConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise BenchConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        check_quantization(self.quantization, self.device, self.dtype)


QUICK = DecodeBenchSettings(batch_sizes=(1, 2), prompt_tokens=16, new_tokens=8, prefill_tokens=64,
                            repeats=1, copy_bytes=64 << 20)


# ---- prompts ------------------------------------------------------------------------------------
def make_prompts(model_path: str, lengths: list[int], vocab_size: int) -> tuple[list[list[int]], str]:
    """One prompt of each length; ShareGPT first turns (each prompt starts at a turn's start,
    topped up with the next turns) in the model's tokenizer, else seeded random ids."""
    try:
        from pdserve.engine.prompts import DatasetError, load_sharegpt_prompts
        from pdserve.engine.tokenizer import Tokenizer
    except ImportError:
        return _random_prompts(lengths, vocab_size), "random"
    try:
        tok = Tokenizer.from_path(model_path)
        n = 4 * len(lengths)
        while True:
            encoded = tok.encode_batch(load_sharegpt_prompts(n, seed=PROMPT_SEED),
                                       add_special_tokens=False)
            prompts = _cut(encoded, lengths)
            if prompts is not None:
                break
            n *= 2
    except DatasetError:
        return _random_prompts(lengths, vocab_size), "random"
    if any(t >= vocab_size for p in prompts for t in p):
        return _random_prompts(lengths, vocab_size), "random"
    return prompts, "sharegpt"


def _cut(encoded: list[list[int]], lengths: list[int]) -> list[list[int]] | None:
    texts = iter(encoded)
    out = []
    for length in lengths:
        buf: list[int] = []
        while len(buf) < length:
            nxt = next(texts, None)
            if nxt is None:
                return None
            buf.extend(nxt)
        out.append(buf[:length])
    return out


def _random_prompts(lengths: list[int], vocab_size: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(PROMPT_SEED)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


# ---- the three systems --------------------------------------------------------------------------
def copy_times_s(nbytes: int, tries: int = 5, device: str = "cpu") -> list[float]:
    """Seconds of `dst.copy_(src)` over `nbytes` in `device` memory; the first copy (page
    faults) is not timed."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(tries):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return times


def make_engine(model_path: str, s: DecodeBenchSettings) -> LLMEngine:
    """One engine for every run: the budget fits the biggest prefill in one step (no chunking)."""
    max_b = max(s.batch_sizes)
    per_seq = -(-(s.prompt_tokens + s.new_tokens + 1) // BLOCK_SIZE_TOKENS)
    num_blocks = max(max_b * per_seq, -(-(s.prefill_tokens + 1) // BLOCK_SIZE_TOKENS)) + max_b
    return LLMEngine(EngineConfig(
        model_path, dtype=s.dtype, device=s.device, quantization=s.quantization,
        cache=CacheConfig(block_size_tokens=BLOCK_SIZE_TOKENS, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_b, max_num_batched_tokens=max(
            max_b * s.prompt_tokens, s.prefill_tokens))))


def _linear_isa() -> str:
    from pdserve.engine import linear_cpu

    return linear_cpu.isa()


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """KV bytes one token holds over every layer (K and V)."""
    k = engine.kv.k
    return 2 * k.shape[0] * k.shape[2] * k.shape[3] * k.element_size()


def engine_decode_s(engine: LLMEngine, prompts: list[list[int]], new_tokens: int, salt: str) -> float:
    """Prefill (untimed; it samples each first token), then time the steps that make `new_tokens`
    more per sequence. A fresh salt per run keeps the prefix cache from serving old blocks."""
    params = SamplingParams(max_tokens=new_tokens + 1, ignore_eos=True)
    pending = {engine.add_request(None, p, params, salt=salt) for p in prompts}
    while pending:
        for out in engine.step():
            pending.discard(out.request_id)
    made = 0
    t0 = time.perf_counter()
    while engine.has_work():
        made += sum(len(o.new_token_ids) for o in engine.step())
    dt = time.perf_counter() - t0
    assert made == len(prompts) * new_tokens, (made, len(prompts), new_tokens)
    return dt


def engine_prefill_s(engine: LLMEngine, prompt: list[int], salt: str) -> tuple[float, int]:
    """Seconds and steps to run one prompt and sample its first token."""
    engine.add_request(None, prompt, SamplingParams(max_tokens=1, ignore_eos=True), salt=salt)
    steps = 0
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
        steps += 1
    return time.perf_counter() - t0, steps


def _with_env(name: str, value: str, fn: Any, *args: Any) -> Any:
    """fn(*args) with the environment variable `name` set to `value` meanwhile."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ[name]
        else:
            os.environ[name] = old


def _with_torch_attention(fn: Any, *args: Any) -> Any:
    """fn(*args) with the engine's decode attention on the PyTorch reference (decided per step)."""
    return _with_env("PDSERVE_PAGED_ATTN", "torch", fn, *args)


# ---- one run --------------------------------------------------------------------------------------
def run_decode_bench(model_path: str, batch_sizes: tuple[int, ...] = (1, 8, 32),
                     prompt_tokens: int = 128, new_tokens: int = 64, prefill_tokens: int = 2048,
                     dtype: str = "float32", repeats: int = 3, progress: bool = True,
                     copy_bytes: int = 512 << 20, attention_baseline: bool = False,
                     device: str = "cpu", linear_baseline: bool = False,
                     quantization: str = "none") -> dict[str, Any]:
    """Measure everything once and return the result document (see `summarize`).

    Per batch size, each repeat runs engine, `generate(N + 1)`, `generate(1)` back to back, so a
    burst of other work on the machine lands on both sides; repeat 0 is the warm-up and dropped.
    """
    s = DecodeBenchSettings(tuple(batch_sizes), prompt_tokens, new_tokens, prefill_tokens, dtype,
                            repeats, device, copy_bytes, attention_baseline, linear_baseline,
                            quantization)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    extra = s.attention_baseline + s.linear_baseline
    runs = 2 + 2 + s.linear_baseline + (1 + s.repeats) * ((3 + extra) * len(s.batch_sizes) + 2)
    bar = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    started = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with bar:
        task = bar.add_task("loading engine", total=runs)

        def tick(what: str) -> None:
            bar.update(task, advance=1, description=what)

        engine = make_engine(model_path, s)
        baselines = []  # (raw key, timed run): the engine another way, alternating with it
        if s.attention_baseline:
            baselines.append(("engine_torch_attention_s", lambda b: _with_torch_attention(
                engine_decode_s, engine, prompts[:b], new_tokens, f"bench-{next(salt)}")))
        if s.linear_baseline:
            tick("loading engine on oneDNN linear")
            onednn = _with_env("PDSERVE_LINEAR", "onednn", make_engine, model_path, s)
            baselines.append(("engine_onednn_linear_s", lambda b: engine_decode_s(
                onednn, prompts[:b], new_tokens, f"bench-{next(salt)}")))
        tick("loading transformers")
        hf = load_hf(model_path, dtype, s.device)
        tick("copy bandwidth")
        pad_id = pad_id_of(hf)
        max_b = max(s.batch_sizes)
        prompts, source = make_prompts(model_path, [prompt_tokens] * max_b + [prefill_tokens],
                                       engine.model_config.vocab_size)
        long_prompt, prompts = prompts[-1], prompts[:-1]
        copies = copy_times_s(s.copy_bytes, device=s.device)
        tick("decode")
        salt = iter(range(1 << 30))
        decode = []
        for b in s.batch_sizes:
            ids, mask = left_pad(prompts[:b], pad_id)
            raw: dict[str, list[float]] = {"engine_s": [], "generate_s": [], "generate_one_s": []}
            for r in range(1 + s.repeats):  # r == 0 warms both sides up and is dropped
                tick(f"decode B={b} engine {r}/{s.repeats}")
                runs_b = [("engine_s", lambda b: engine_decode_s(
                    engine, prompts[:b], new_tokens, f"bench-{next(salt)}")), *baselines]
                order = range(len(runs_b))
                for i in (reversed(order) if r % 2 else order):  # which goes first alternates
                    key, fn = runs_b[i]
                    if i:
                        tick(f"decode B={b} {key[7:-2].replace('_', ' ')} {r}/{s.repeats}")
                    t = fn(b)
                    if i == 0:
                        e = t
                    elif r:
                        raw.setdefault(key, []).append(t)
                tick(f"decode B={b} transformers {r}/{s.repeats}")
                # The one-token run (the prefill both include) is the smaller of one before and
                # one after: a hiccup of the machine in a single short run would otherwise make
                # the decode's difference wrong, even negative.
                one = hf_generate_s(hf, ids, mask, 1, pad_id)
                full = hf_generate_s(hf, ids, mask, new_tokens + 1, pad_id)
                tick(f"decode B={b} transformers 1 {r}/{s.repeats}")
                one = min(one, hf_generate_s(hf, ids, mask, 1, pad_id))
                if r:
                    raw["engine_s"].append(e)
                    raw["generate_s"].append(full)
                    raw["generate_one_s"].append(one)
            decode.append((b, raw))
        pre: dict[str, list[float]] = {"engine_s": [], "transformers_s": []}
        steps = []
        for r in range(1 + s.repeats):
            tick(f"prefill engine {r}/{s.repeats}")
            e, n = engine_prefill_s(engine, long_prompt, f"bench-{next(salt)}")
            tick(f"prefill transformers {r}/{s.repeats}")
            h = hf_prefill_s(hf, long_prompt)
            if r:
                pre["engine_s"].append(e)
                pre["transformers_s"].append(h)
                steps.append(n)
        # Again at the end: the best of both phases counts.
        copies += copy_times_s(s.copy_bytes, device=s.device)
        bar.update(task, advance=1, description="done")
    setup = {
        "model_path": model_path, "prompt_source": source,
        "weight_bytes": engine.model.weight_bytes(),
        "max_num_batched_tokens": engine.cfg.scheduler.max_num_batched_tokens,
        "num_blocks": engine.cfg.cache.num_blocks, "block_size_tokens": BLOCK_SIZE_TOKENS,
        "engine_prefill_steps": steps, "loadavg_1m_start": load_start,
        "loadavg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "transformers_version": sys.modules["transformers"].__version__,
        "decode_attention": describe_decode_path(engine.kv.k.dtype, engine.kv.k.device),
        # How each engine multiplies its weights (`Linear.kind`: c, onednn or plain).
        "linear": engine.model.lm_head.kind,
        **({"linear_isa": _linear_isa()} if engine.model.lm_head.kind == "c" else {}),
        **({"linear_baseline": onednn.model.lm_head.kind} if s.linear_baseline else {}),
        "wall_s": time.perf_counter() - started,
        "device_name": device_name(s.device), "kv_bytes_per_token": kv_bytes_per_token(engine),
    }
    return summarize(s, setup, copies, decode, pre)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = DecodeBenchSettings()
    parser.add_argument("--model", help="HF folder or .gguf file (default: SmolLM2-135M GGUF)")
    parser.add_argument("--batch-sizes", type=number_list("--batch-sizes"),
                        default=d.batch_sizes,
                        help="comma-separated (default 1,8,32)")
    parser.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens)
    parser.add_argument("--prefill-tokens", type=int, default=d.prefill_tokens)
    parser.add_argument("--device", default="cpu", metavar="auto|cpu|cuda|cuda:N",
                        help="where the engine, transformers and the copy run (default cpu)")
    parser.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                        help="auto: bfloat16 on a GPU, float32 on the CPU")
    parser.add_argument("--repeats", type=int, default=d.repeats, help="timed runs per figure")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--out", metavar="DIR", help="also write DIR/decode.json and DIR/decode.png")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for tests: batch 1,2; 16+8 tokens; 64 prefill; 1 repeat")
    parser.add_argument("--threads", type=int, help="torch threads (default: leave as is)")
    parser.add_argument("--attention-baseline", action="store_true",
                        help="also time the engine with PDSERVE_PAGED_ATTN=torch (the PyTorch "
                             "reference decode attention) in the same run")
    parser.add_argument("--linear-baseline", action="store_true",
                        help="also time a second engine whose linear layers run on oneDNN's "
                             "packed weights (PDSERVE_LINEAR=onednn) in the same run")
    parser.add_argument("--quantization", choices=["none", "int8"], default="none",
                        help="int8: the engine's projection weights int8 per output channel "
                             "(CPU, float32 only; default none)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        from pdserve.engine.loader import default_model_path
        args.model = default_model_path()
    problem = threads_problem("pdserve bench decode", args.threads)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    q = QUICK
    sizes = dict(batch_sizes=q.batch_sizes, prompt_tokens=q.prompt_tokens,
                 new_tokens=q.new_tokens, prefill_tokens=q.prefill_tokens, repeats=q.repeats,
                 copy_bytes=q.copy_bytes) if args.quick else dict(
        batch_sizes=args.batch_sizes, prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens, prefill_tokens=args.prefill_tokens, repeats=args.repeats)
    try:
        with torch_threads(args.threads):
            device = resolve_device(args.device)
            result = run_decode_bench(args.model, dtype=resolve_dtype(args.dtype, device),
                                      device=device, progress=not args.no_progress,
                                      attention_baseline=args.attention_baseline,
                                      linear_baseline=args.linear_baseline,
                                      quantization=args.quantization, **sizes)
    except (BenchConfigError, DeviceError) as e:
        print(f"pdserve bench decode: {e}", file=sys.stderr)
        return 2
    return emit(result, json_out=args.json, out_dir=args.out, write_outputs=write_outputs,
                print_tables=print_table)


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="pdserve bench decode", description=__doc__.split("\n", 1)[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
