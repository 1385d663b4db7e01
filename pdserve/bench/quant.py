"""`pdserve bench quant`: what int8 weight-only linear layers cost in accuracy, and gain in speed.

Owns one run, in one process on the CPU: an fp32 engine and an int8 one (`EngineConfig.
quantization`) on the same weights; greedy decoding of held-out ShareGPT prompts on both (the
drafters' held-out split, as `bench spec` uses), compared token by token up to each prompt's
first divergence; teacher-forced next-token distributions along the fp32 output (the logprob of
the token fp32 chose under both models, and KL(fp32 || int8) per position); and engine decode
speed of both at a few batch sizes with the same threads, through `bench decode`'s prompts and
timed runs, alternating which engine goes first. The teacher-forced pass runs the model's
forward on a whole sequence through the paged cache, as the parity tests do. Reports and plots
(`quant_report.py`); it must not assert an aim or change either engine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

from pdserve.bench.common import number_list, threads_problem, torch_threads
from pdserve.output import emit
from pdserve.core.errors import ConfigError as BenchConfigError
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.device import QUANTIZATION_CHOICES
from pdserve.engine.engine import LLMEngine
from pdserve.engine.sampling import SamplingParams

BLOCK_SIZE_TOKENS = 16


@dataclass(frozen=True)
class QuantBenchSettings:
    """What one run measures; validated here so a bad CLI value fails before a model loads."""

    quantization: str = "int8"
    prompts: int = 32  # held-out prompts for the accuracy figures
    new_tokens: int = 64  # greedy tokens per prompt compared
    max_prompt_tokens: int = 256
    agree_at: tuple[int, ...] = (1, 8, 16, 32, 64)  # share of prompts whose first N all agree
    batch_sizes: tuple[int, ...] = (1, 32)  # decode speed
    speed_prompt_tokens: int = 128
    speed_new_tokens: int = 32
    repeats: int = 3

    def __post_init__(self) -> None:
        if self.quantization not in QUANTIZATION_CHOICES or self.quantization == "none":
            raise BenchConfigError(f"quantization must be int8, got {self.quantization!r}")
        for name in ("prompts", "new_tokens", "max_prompt_tokens", "speed_prompt_tokens",
                     "speed_new_tokens", "repeats"):
            if getattr(self, name) <= 0:
                raise BenchConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            raise BenchConfigError(f"batch_sizes must be positive, got {self.batch_sizes}")
        if any(not 1 <= n <= self.new_tokens for n in self.agree_at):
            raise BenchConfigError(f"agree_at must be within 1..new_tokens ({self.new_tokens}), "
                                   f"got {self.agree_at}")


QUICK = QuantBenchSettings(prompts=2, new_tokens=8, max_prompt_tokens=64, agree_at=(1, 8),
                           batch_sizes=(1, 2), speed_prompt_tokens=16, speed_new_tokens=4,
                           repeats=1)


def make_engine(model_path: str, quantization: str, s: QuantBenchSettings) -> LLMEngine:
    """An engine for both parts of the run: room for every accuracy prompt at once and for the
    largest decode batch, each prompt's prefill in one step."""
    acc = s.prompts * -(-(s.max_prompt_tokens + s.new_tokens + 1) // BLOCK_SIZE_TOKENS)
    speed = max(s.batch_sizes) * -(-(s.speed_prompt_tokens + s.speed_new_tokens + 1)
                                   // BLOCK_SIZE_TOKENS)
    return LLMEngine(EngineConfig(
        model_path, dtype="float32", device="cpu", quantization=quantization,
        cache=CacheConfig(block_size_tokens=BLOCK_SIZE_TOKENS, num_blocks=max(acc, speed) + 8),
        scheduler=SchedulerConfig(
            max_num_seqs=max(s.prompts, *s.batch_sizes),
            max_num_batched_tokens=max(s.max_prompt_tokens + s.new_tokens,
                                       max(s.batch_sizes) * s.speed_prompt_tokens))))


# ---- accuracy -------------------------------------------------------------------------------------
def greedy(engine: LLMEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    return engine.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))


def sequence_logprobs(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Log-softmax of the logits at every position of `ids`, one forward through the cache."""
    return torch.log_softmax(engine.prompt_logits(ids), dim=-1)


def first_divergence(ref: list[int], out: list[int]) -> int:
    """How many leading tokens agree."""
    n = 0
    for a, b in zip(ref, out):
        if a != b:
            break
        n += 1
    return n


def agreement(refs: list[list[int]], outs: list[list[int]], agree_at: tuple[int, ...]
              ) -> dict[str, Any]:
    """Per position i, the share of prompts whose first i+1 tokens all agree; at each N of
    `agree_at` the same share; the mean agreeing prefix."""
    n = len(refs[0])
    prefix = [first_divergence(r, o) for r, o in zip(refs, outs)]
    curve = [sum(p > i for p in prefix) / len(prefix) for i in range(n)]
    return {"prefix_tokens": prefix, "mean_prefix_tokens": sum(prefix) / len(prefix),
            "all_agree_share_by_position": curve,
            "all_agree_share": {str(k): curve[k - 1] for k in agree_at},
            "token_agreement": sum(a == b for r, o in zip(refs, outs) for a, b in zip(r, o))
            / (n * len(refs))}


def teacher_forced(ref: LLMEngine, quant: LLMEngine, prompt: list[int], tokens: list[int]
                   ) -> dict[str, list[float]]:
    """Along prompt + fp32's tokens: per generated position, |logprob difference| of the
    token fp32 chose, KL(fp32 || quant) of the next-token distribution, top-1 agreement."""
    ids = prompt + tokens[:-1]
    rows = slice(len(prompt) - 1, len(ids))
    lp_ref = sequence_logprobs(ref, ids)[rows]
    lp_q = sequence_logprobs(quant, ids)[rows]
    chosen = torch.tensor(tokens)
    pick = torch.arange(len(tokens))
    diff = (lp_ref[pick, chosen] - lp_q[pick, chosen]).abs()
    kl = (lp_ref.exp() * (lp_ref - lp_q)).sum(-1).clamp_min(0)
    top1 = (lp_ref.argmax(-1) == lp_q.argmax(-1)).float()
    return {"logprob_abs_diff": diff.tolist(), "kl": kl.tolist(), "top1": top1.tolist()}


def summarize_logprobs(per_prompt: list[dict[str, list[float]]]) -> dict[str, float]:
    diff = [d for p in per_prompt for d in p["logprob_abs_diff"]]
    kl = [k for p in per_prompt for k in p["kl"]]
    top1 = [t for p in per_prompt for t in p["top1"]]
    return {"positions": len(diff), "logprob_abs_diff_mean": sum(diff) / len(diff),
            "logprob_abs_diff_max": max(diff), "kl_mean": sum(kl) / len(kl),
            "kl_max": max(kl), "teacher_forced_top1_agreement": sum(top1) / len(top1)}


# ---- speed ----------------------------------------------------------------------------------------
def decode_speed(engines: dict[str, LLMEngine], prompts: list[list[int]], s: QuantBenchSettings,
                 tick: Any) -> list[dict[str, Any]]:
    """Decode seconds per batch size for each engine (`bench decode`'s timed run); repeat 0
    warms up and is dropped; which engine goes first alternates."""
    from pdserve.bench.decode import engine_decode_s

    names = list(engines)
    salt = iter(range(1 << 30))
    rows = []
    for b in s.batch_sizes:
        times: dict[str, list[float]] = {n: [] for n in names}
        for r in range(1 + s.repeats):
            for name in (reversed(names) if r % 2 else names):
                tick(f"decode B={b} {name} {r}/{s.repeats}")
                t = engine_decode_s(engines[name], prompts[:b], s.speed_new_tokens,
                                    f"quant-{next(salt)}")
                if r:
                    times[name].append(t)
        tokens = b * s.speed_new_tokens
        row: dict[str, Any] = {"batch_size": b}
        for name in names:
            best = min(times[name])
            row[name] = {"seconds": times[name], "tokens_per_s": tokens / best}
        row["speedup"] = row[names[1]]["tokens_per_s"] / row[names[0]]["tokens_per_s"]
        rows.append(row)
    return rows


# ---- one run ----------------------------------------------------------------------------------------
def run_quant_bench(model_path: str, s: QuantBenchSettings = QuantBenchSettings(),
                    progress: bool = True) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    from pdserve.bench.decode import make_prompts
    from pdserve.bench.spec import HELDOUT_RULE, heldout_prompts

    q = s.quantization
    runs = 3 + s.prompts + 2 * (1 + s.repeats) * len(s.batch_sizes) + 1
    bar = Progress(TextColumn("{task.description:<30}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    started = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with bar:
        task = bar.add_task("loading fp32 engine", total=runs)

        def tick(what: str) -> None:
            bar.update(task, advance=1, description=what)

        ref = make_engine(model_path, "none", s)
        tick(f"loading {q} engine")
        quant = make_engine(model_path, q, s)
        vocab = ref.model_config.vocab_size
        prompts, source = heldout_prompts(model_path, s.prompts, s.max_prompt_tokens, vocab)
        tick("greedy fp32")
        ref_out = greedy(ref, prompts, s.new_tokens)
        tick(f"greedy {q}")
        q_out = greedy(quant, prompts, s.new_tokens)
        per_prompt = []
        for i, (p, toks) in enumerate(zip(prompts, ref_out)):
            tick(f"teacher-forced {i + 1}/{s.prompts}")
            per_prompt.append(teacher_forced(ref, quant, p, toks))
        speed_prompts, speed_source = make_prompts(
            model_path, [s.speed_prompt_tokens] * max(s.batch_sizes), vocab)
        speed = decode_speed({"fp32": ref, q: quant}, speed_prompts, s, tick)
        bar.update(task, advance=1, description="done")
    return {
        "bench": "quant", "quantization": q,
        "settings": {k: (list(v) if isinstance(v, tuple) else v)
                     for k, v in vars(s).items()},
        "model": {"path": model_path, "lm_head": ref.model.lm_head.kind + " / "
                  + quant.model.lm_head.kind,
                  "weight_bytes": {"fp32": ref.model.weight_bytes(),
                                   q: quant.model.weight_bytes()}},
        "prompts": {"source": source, "heldout_rule": HELDOUT_RULE,
                    "lengths": [len(p) for p in prompts], "speed_source": speed_source},
        "greedy": agreement(ref_out, q_out, s.agree_at),
        "logprobs": summarize_logprobs(per_prompt),
        "decode": speed,
        "machine": {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
                    "loadavg_1m_start": load_start,
                    "loadavg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                    "linear_isa": _isa(), "date": time.strftime("%Y-%m-%d")},
        "wall_s": time.perf_counter() - started,
    }


def _isa() -> str | None:
    from pdserve.engine import linear_int8

    return linear_int8.isa() if linear_int8.available() else None


# ---- CLI -------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = QuantBenchSettings()
    parser.add_argument("--model", help="HF folder or .gguf file (default: SmolLM2-135M GGUF)")
    parser.add_argument("--quantization", choices=["int8"], default=d.quantization,
                        help="the mode compared with fp32 (default int8)")
    parser.add_argument("--prompts", type=int, default=d.prompts,
                        help=f"held-out ShareGPT prompts compared (default {d.prompts})")
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens,
                        help=f"greedy tokens per prompt (default {d.new_tokens})")
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    parser.add_argument("--agree-at", type=number_list("--agree-at", example="1,8,32"),
                        default=d.agree_at, help="report the share of prompts whose first N "
                                                 "tokens all agree, for these N")
    parser.add_argument("--batch-sizes", type=number_list("--batch-sizes"),
                        default=d.batch_sizes, help="decode speed batch sizes (default 1,32)")
    parser.add_argument("--speed-new-tokens", type=int, default=d.speed_new_tokens)
    parser.add_argument("--repeats", type=int, default=d.repeats, help="timed runs per figure")
    parser.add_argument("--threads", type=int, help="torch threads (default: leave as is)")
    parser.add_argument("--quick", action="store_true", help="tiny run for tests")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--out", metavar="DIR", help="also write DIR/quant.json and DIR/quant.png")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def run(args: argparse.Namespace) -> int:
    from pdserve.bench.quant_report import print_table, write_outputs

    if args.model is None:
        from pdserve.engine.loader import default_model_path
        args.model = default_model_path()
    problem = threads_problem("pdserve bench quant", args.threads)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    try:
        s = QUICK if args.quick else QuantBenchSettings(
            args.quantization, args.prompts, args.new_tokens, args.max_prompt_tokens,
            tuple(args.agree_at), tuple(args.batch_sizes), QuantBenchSettings.speed_prompt_tokens,
            args.speed_new_tokens, args.repeats)
        with torch_threads(args.threads):
            result = run_quant_bench(args.model, s, progress=not args.no_progress)
    except BenchConfigError as e:
        print(f"pdserve bench quant: {e}", file=sys.stderr)
        return 2
    return emit(result, json_out=args.json, out_dir=args.out, write_outputs=write_outputs,
                print_tables=print_table)


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="pdserve bench quant", description=__doc__.split("\n", 1)[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
