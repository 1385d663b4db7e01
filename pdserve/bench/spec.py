"""`pdserve bench spec`: speculative decoding speed-up per drafter and batch size, and its losslessness.

Owns one benchmark run in one process: for each method ("none" is the no-speculation baseline;
"ngram"; the trained drafters "eagle", "dflash", "dspark") and batch size, one engine (fp32,
greedy, ignore_eos so every request makes exactly max_tokens) runs `batch` held-out ShareGPT
prompts concurrently. It reports decode tokens/s, the acceptance length, tokens per target step,
the speed-up over "none" at the same batch size in the same run, and whether every greedy output
equals the "none" output token for token (invariant 2; the command exits 1 if not).

Timing: only the decode phase. Steps run untimed until every request has its first token (the
prefill); the clock then runs to the end, and tokens/s = tokens emitted in that phase / its
seconds. Acceptance length = (accepted drafts + verifications) / verifications over that phase's
steps that verified drafts; tokens per step also counts the steps where a request ran without
drafts (none proposed, or the scheduler cut them all). Per batch size the methods run back to
back, so a burst of other load lands on all of them. It drives `LLMEngine` through its public API
only, and reports the figures; it must not assert speed.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from pdserve.core.errors import ConfigError as BenchConfigError  # bad setting: names it
from pdserve.bench.common import number_list, threads_problem, torch_threads
from pdserve.output import emit
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.model_runner import DTYPES
from pdserve.engine.sampling import SamplingParams

METHODS = ("none", "ngram", "eagle", "dflash", "dspark")
MODEL_DRAFTERS = ("eagle", "dflash", "dspark")
BLOCK_SIZE_TOKENS = 16


@dataclass(frozen=True)
class SpecBenchSettings:
    methods: tuple[str, ...] = METHODS
    batch_sizes: tuple[int, ...] = (1, 8, 32)
    gamma: int = 4
    max_tokens: int = 64
    num_prompts: int | None = None  # None: the largest batch size
    max_prompt_tokens: int = 256
    schedule: bool = True
    repeats: int = 1
    dtype: str = "float32"

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise BenchConfigError(f"--methods must be from {','.join(METHODS)}, got {bad or '[]'}")
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            raise BenchConfigError(f"--batch-sizes must be positive, got {self.batch_sizes}")
        for name in ("gamma", "max_prompt_tokens", "repeats"):
            if getattr(self, name) <= 0:
                raise BenchConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.max_tokens < 2:
            raise BenchConfigError("--max-tokens must be at least 2 (one prefill token, then decode)")
        if self.num_prompts is not None and self.num_prompts < max(self.batch_sizes):
            raise BenchConfigError(f"--num-prompts ({self.num_prompts}) must cover the largest "
                                   f"batch ({max(self.batch_sizes)})")

    @property
    def prompts_needed(self) -> int:
        return self.num_prompts or max(self.batch_sizes)

    @property
    def all_methods(self) -> tuple[str, ...]:
        """The methods run: "none" always (every speed-up and exactness check needs it), first."""
        return ("none",) + tuple(dict.fromkeys(m for m in self.methods if m != "none"))


QUICK = dict(batch_sizes=(1, 2), gamma=2, max_tokens=8, num_prompts=2, max_prompt_tokens=64)


# ---- prompts -------------------------------------------------------------------------------------
HELDOUT_RULE = "pdserve.engine.spec.train.split_prompts(held_out=True): sha256(text)[0] < 32"


def _render(tok: Any, text: str) -> list[int]:
    if tok.chat_template:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]),
                          add_special_tokens=False)
    return tok.encode(text)


def heldout_prompts(model_path: str, n: int, max_prompt_tokens: int,
                    vocab_size: int) -> tuple[list[list[int]], str]:
    """`n` ShareGPT first user turns from the drafters' held-out split (never trained on),
    rendered with the model's chat template, each at most `max_prompt_tokens` tokens; seeded
    random ids if the dataset or tokenizer is missing."""
    try:
        from pdserve.engine.spec.train import split_prompts
        from pdserve.engine.tokenizer import Tokenizer

        tok = Tokenizer.from_path(model_path)
        # ~4 characters a token in English; longer prompts are dropped after rendering.
        max_chars = min(1000, 3 * max_prompt_tokens)
        out: list[list[int]] = []
        for ask in (n, 2 * n, 4 * n):
            out = [ids for ids in (_render(tok, t) for t in split_prompts(
                ask, held_out=True, max_chars=max_chars))
                if len(ids) <= max_prompt_tokens and all(t < vocab_size for t in ids)][:n]
            if len(out) == n:
                break
        if out:  # a short supply is cycled rather than replaced
            out = [out[i % len(out)] for i in range(n)]
            return out, "sharegpt-heldout" + ("+chat" if tok.chat_template else "")
    except (ImportError, OSError, ValueError):  # DatasetError, TokenizerError are ValueErrors
        pass
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab_size, (max_prompt_tokens,), generator=gen).tolist()
            for _ in range(n)], "random"


# ---- engines -------------------------------------------------------------------------------------
def draft_dir(method: str, model_path: str, progress: bool = True) -> str:
    """The default trained drafter of `method` for this target, trained first if missing (that
    takes minutes); ImportError when the trainer is not there."""
    from pdserve.engine.spec.train import ensure_default_draft

    return ensure_default_draft(method, target_path=model_path, progress=progress)


def make_engine(model_path: str, model_config: Any, weights: dict[str, torch.Tensor],
                method: str, draft_path: str | None, s: SpecBenchSettings) -> LLMEngine:
    """Room for the largest batch at once: every prompt prefills in one step, no preemption."""
    max_b = max(s.batch_sizes)
    per_seq = -(-(s.max_prompt_tokens + s.max_tokens + s.gamma + 1) // BLOCK_SIZE_TOKENS)
    spec = None if method == "none" else SpecConfig(
        method=method, num_speculative_tokens=s.gamma, draft_path=draft_path,
        schedule=s.schedule)
    return LLMEngine(EngineConfig(
        model_path, dtype=s.dtype,
        cache=CacheConfig(block_size_tokens=BLOCK_SIZE_TOKENS, num_blocks=max_b * (per_seq + 1)),
        scheduler=SchedulerConfig(max_num_seqs=max_b, max_num_batched_tokens=max(
            max_b * s.max_prompt_tokens, max_b * (1 + s.gamma), 2048)),
        spec=spec), model_config=model_config, weights=weights)


_SPEC_KEYS = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
              "spec_decode_num_accepted_tokens")


@dataclass
class RunResult:
    outputs: list[list[int]]
    decode_s: float
    decode_tokens: int
    steps: int  # target forwards in the decode phase
    request_steps: int  # sum over those steps of the requests that got a token
    spec: dict[str, Any] = field(default_factory=dict)  # stats deltas over the decode phase


def run_batch(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, salt: str) -> RunResult:
    """Run the prompts together to max_tokens each; time the decode phase only. A fresh salt
    keeps the prefix cache from serving an earlier run's blocks."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    rids = [engine.add_request(None, p, params, salt=salt) for p in prompts]
    outs: dict[str, list[int]] = {r: [] for r in rids}
    no_first = set(rids)
    while no_first:
        for o in engine.step():
            outs[o.request_id].extend(o.new_token_ids)
            no_first.discard(o.request_id)
    before = engine.stats()
    tokens = steps = request_steps = 0
    t0 = time.perf_counter()
    while engine.has_work():
        step_out = engine.step()
        for o in step_out:
            outs[o.request_id].extend(o.new_token_ids)
            tokens += len(o.new_token_ids)
        steps += 1
        request_steps += sum(1 for o in step_out if o.new_token_ids)
    dt = time.perf_counter() - t0
    after = engine.stats()
    spec: dict[str, Any] = {}
    if "spec_decode_num_drafts" in after:
        spec = {k: after[k] - before[k] for k in _SPEC_KEYS}
        spec["spec_decode_num_accepted_tokens_per_pos"] = [
            a - b for a, b in zip(after["spec_decode_num_accepted_tokens_per_pos"],
                                  before["spec_decode_num_accepted_tokens_per_pos"])]
    return RunResult([outs[r] for r in rids], dt, tokens, steps, request_steps, spec)


# ---- one run of the bench ------------------------------------------------------------------------
def prepare_drafters(methods: tuple[str, ...], model_path: str, progress: bool
                     ) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """(draft dirs, skipped, errors) per model drafter in `methods`; runs before the progress
    bar because training a missing drafter shows its own."""
    paths: dict[str, str] = {}
    skipped: dict[str, str] = {}
    errors: dict[str, str] = {}
    for m in methods:
        if m not in MODEL_DRAFTERS:
            continue
        try:
            paths[m] = draft_dir(m, model_path, progress)
        except ImportError as e:  # the trainer or drafter module is not there: say so, go on
            skipped[m] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - one broken drafter must not lose the rest
            errors[m] = f"{type(e).__name__}: {e}"
    return paths, skipped, errors


def run_spec_bench_doc(model_path: str, s: SpecBenchSettings, progress: bool = True) -> dict[str, Any]:
    """Measure everything once and return the result document (see `summarize`)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from pdserve.engine.loader import load_checkpoint

    started = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    paths, skipped, errors = prepare_drafters(s.all_methods, model_path, progress)
    methods = [m for m in s.all_methods if m not in skipped and m not in errors]
    total = 1 + len(methods) + len(s.batch_sizes) * s.repeats * len(methods)
    bar = Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    engines: dict[str, LLMEngine] = {}
    raw: dict[tuple[str, int], list[RunResult]] = {}
    with bar:
        task = bar.add_task("loading weights, prompts", total=total)

        def tick(what: str) -> None:
            bar.update(task, advance=1, description=what)

        model_config, weights = load_checkpoint(model_path, DTYPES[s.dtype])
        prompts, source = heldout_prompts(model_path, s.prompts_needed, s.max_prompt_tokens,
                                          model_config.vocab_size)
        for m in methods:
            tick(f"{m}: engine + warm-up")
            try:
                engine = make_engine(model_path, model_config, weights, m, paths.get(m), s)
                # The warm-up also covers one-off work of the first drafted step (the
                # scheduler's step-cost profile), so it never lands in a timed run.
                run_batch(engine, prompts[:min(2, len(prompts))], min(6, s.max_tokens), "warmup")
            except ImportError as e:
                if m == "none":
                    raise
                skipped[m] = f"{type(e).__name__}: {e}"
                continue
            except Exception as e:  # noqa: BLE001
                if m == "none":
                    raise
                errors[m] = f"{type(e).__name__}: {e}"
                continue
            engines[m] = engine
        salt = iter(range(1 << 30))
        for b in s.batch_sizes:
            for r in range(s.repeats):
                for m in methods:
                    tick(f"B={b} {m} {r + 1}/{s.repeats}")
                    if m in engines:
                        raw.setdefault((m, b), []).append(
                            run_batch(engines[m], prompts[:b], s.max_tokens, f"spec-{next(salt)}"))
        bar.update(task, completed=total, description="done")
    setup = {"model_path": model_path, "prompt_source": source,
             "prompt_tokens": [len(p) for p in prompts],
             "max_num_batched_tokens": engines["none"].cfg.scheduler.max_num_batched_tokens,
             "num_blocks": engines["none"].cfg.cache.num_blocks,
             "loadavg_1m_start": load_start,
             "loadavg_1m_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
             "wall_s": time.perf_counter() - started}
    return summarize(s, setup, raw, skipped, errors)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(s: SpecBenchSettings, setup: dict[str, Any],
              raw: dict[tuple[str, int], list[RunResult]], skipped: dict[str, str],
              errors: dict[str, str]) -> dict[str, Any]:
    """The result document from the raw runs: pure (no clock, no I/O)."""
    rows = []
    for b in s.batch_sizes:
        base_runs = raw[("none", b)]
        reference = base_runs[0].outputs
        base_tps = max(r.decode_tokens / r.decode_s for r in base_runs)
        for m in s.all_methods:
            if m in skipped or m in errors:
                rows.append({"method": m, "batch_size": b,
                             "status": "skipped" if m in skipped else "error",
                             "reason": skipped.get(m) or errors.get(m)})
                continue
            runs = raw[(m, b)]
            tps = max(r.decode_tokens / r.decode_s for r in runs)
            mismatched = sorted({i for r in runs for i, (o, ref) in
                                 enumerate(zip(r.outputs, reference)) if o != ref})
            spec = {k: sum(r.spec.get(k, 0) for r in runs) for k in _SPEC_KEYS}
            drafts, accepted = spec["spec_decode_num_drafts"], spec["spec_decode_num_accepted_tokens"]
            per_pos = [sum(x) for x in zip(*(r.spec["spec_decode_num_accepted_tokens_per_pos"]
                                             for r in runs))] if m != "none" else []
            tokens = sum(r.decode_tokens for r in runs)
            rows.append({
                "method": m, "batch_size": b, "status": "ok",
                "decode_s": [r.decode_s for r in runs],
                "decode_tokens": tokens,
                "tokens_per_s": tps,
                "speedup": tps / base_tps,
                # emitted tokens per verification that had drafts: accepted drafts + the bonus
                "acceptance_length": _ratio(accepted + drafts, drafts) if m != "none" else 1.0,
                # emitted tokens per request per target step, steps without drafts included
                "tokens_per_step": _ratio(tokens, sum(r.request_steps for r in runs)),
                "target_steps": sum(r.steps for r in runs),
                "drafts": drafts,
                "draft_tokens": spec["spec_decode_num_draft_tokens"],
                "mean_draft_len": _ratio(spec["spec_decode_num_draft_tokens"], drafts),
                "accepted_tokens": accepted,
                "acceptance_rate": _ratio(accepted, spec["spec_decode_num_draft_tokens"]),
                "accepted_per_pos": per_pos,
                "exact": not mismatched,
                "mismatched_prompts": mismatched,
            })
    ok = [r for r in rows if r["status"] == "ok"]
    return {
        "bench": "spec",
        "machine": {
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "processor": platform.processor() or None,
            "python": platform.python_version(), "torch": torch.__version__, "device": "cpu",
            "loadavg_1m_start": setup["loadavg_1m_start"],
            "loadavg_1m_end": setup["loadavg_1m_end"],
        },
        "model": {"path": setup["model_path"], "dtype": s.dtype},
        "settings": {**asdict(s), "methods": list(s.all_methods),
                     "batch_sizes": list(s.batch_sizes), "num_prompts": s.prompts_needed,
                     "prompt_source": setup["prompt_source"],
                     "heldout_rule": HELDOUT_RULE,
                     "prompt_tokens": setup["prompt_tokens"],
                     "max_num_batched_tokens": setup["max_num_batched_tokens"],
                     "num_blocks": setup["num_blocks"], "block_size_tokens": BLOCK_SIZE_TOKENS,
                     "timing": "decode phase only: from every request having its first token "
                               "to the last step; fastest of the repeats (other processes only add time)"},
        "rows": rows,
        "skipped": skipped,
        "errors": errors,
        "all_exact": all(r["exact"] for r in ok),
        "wall_s": setup["wall_s"],
    }


# ---- CLI -----------------------------------------------------------------------------------------
def _methods(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = SpecBenchSettings()
    parser.add_argument("--model", help="HF folder or .gguf file (default: SmolLM2-135M GGUF)")
    parser.add_argument("--methods", type=_methods, default=d.methods,
                        help=f"comma-separated from {','.join(METHODS)} (default all); "
                             "'none' (no speculation) always runs as the baseline")
    parser.add_argument("--batch-sizes", type=number_list("--batch-sizes"),
                        default=d.batch_sizes,
                        help="comma-separated (default 1,8,32)")
    parser.add_argument("--gamma", type=int, default=d.gamma, help="most draft tokens per step")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens,
                        help="tokens per request (ignore_eos: all equal)")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="held-out prompts loaded (default: the largest batch)")
    parser.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    parser.add_argument("--schedule", action=argparse.BooleanOptionalAction, default=d.schedule,
                        help="confidence-scheduled draft lengths (default on)")
    parser.add_argument("--repeats", type=int, default=d.repeats, help="timed runs per figure")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--out", metavar="DIR",
                        help="also write DIR/results.json and DIR/speedup.png")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for tests: batch 1,2; gamma 2; 8 tokens; 2 prompts")
    parser.add_argument("--threads", type=int, help="torch threads (default: leave as is)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def add_spec_bench_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """Register `spec` under `pdserve bench`."""
    p = bench_subparsers.add_parser(
        "spec", help="speculative decoding speed-up and exactness per drafter and batch size")
    add_arguments(p).set_defaults(func=run_spec_bench)
    return p


def run_spec_bench(args: argparse.Namespace) -> int:
    """0: every row ran and matched the no-speculation output; 1: a mismatch or a drafter
    error; 2: a bad setting."""
    from pdserve.bench import spec_report

    if args.model is None:
        from pdserve.engine.loader import default_model_path
        args.model = default_model_path()
    problem = threads_problem("pdserve bench spec", args.threads)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    sizes = QUICK if args.quick else dict(
        batch_sizes=args.batch_sizes, gamma=args.gamma, max_tokens=args.max_tokens,
        num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens)
    try:
        s = SpecBenchSettings(methods=args.methods, schedule=args.schedule,
                              repeats=1 if args.quick else args.repeats, **sizes)
        with torch_threads(args.threads):
            result = run_spec_bench_doc(args.model, s, progress=not args.no_progress)
    except BenchConfigError as e:
        print(f"pdserve bench spec: {e}", file=sys.stderr)
        return 2
    emit(result, json_out=args.json, out_dir=args.out, write_outputs=spec_report.write_outputs,
         print_tables=spec_report.print_tables)
    return 0 if result["all_exact"] and not result["errors"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="pdserve bench spec", description=__doc__.split("\n", 1)[0]))
    return run_spec_bench(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
