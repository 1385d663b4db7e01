"""`pdserve bench decode`: engine decode and prefill speed vs `transformers` and the bandwidth bound.

Owns one benchmark run, all on this machine in one process: engine decode tokens/s per batch size
(with `--attention-baseline` also with the PyTorch reference decode attention instead of the C
kernel, alternating which goes first), Hugging Face `generate` on the same weights and the same
prompt token ids, the memory-bandwidth bound (a large tensor copy), and one long prefill on both
sides; then the ratios, a table, a JSON document and a plot. Decode time on the `transformers` side is `generate(N + 1) - generate(1)`
(both include the same prefill), so both sides time exactly `N` decode steps per sequence.
It drives `LLMEngine` through its public API only, and reports the aims; it must not assert them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from pdserve.core.errors import ConfigError as BenchConfigError  # bad setting: names it
from pdserve.bench.common import emit, number_list
from pdserve.engine.attention import describe_decode_path
from pdserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve.engine.engine import DTYPES, LLMEngine
from pdserve.engine.sampling import SamplingParams

AIMS = {"aim_ratio_b1": (1, 1.5), "aim_ratio_b32": (32, 2.0)}  # name: (batch size, engine/HF)
BLOCK_SIZE_TOKENS = 16
PROMPT_SEED = 0


class BenchError(RuntimeError):
    """A measurement came out unusable (e.g. noise larger than the thing measured)."""


@dataclass(frozen=True)
class DecodeBenchSettings:
    """What one run measures; validated here so a bad CLI value fails before any model loads."""

    batch_sizes: tuple[int, ...] = (1, 8, 32)
    prompt_tokens: int = 128
    new_tokens: int = 64
    prefill_tokens: int = 2048
    dtype: str = "float32"
    repeats: int = 3
    copy_bytes: int = 512 << 20
    # Also time the engine with the PyTorch reference decode attention (PDSERVE_PAGED_ATTN=torch)
    # right after each engine run: the C kernel's gain, measured in the same run.
    attention_baseline: bool = False

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b <= 0 for b in self.batch_sizes):
            raise BenchConfigError(f"batch_sizes must be positive, got {self.batch_sizes}")
        for name in ("prompt_tokens", "new_tokens", "prefill_tokens", "repeats", "copy_bytes"):
            if getattr(self, name) <= 0:
                raise BenchConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise BenchConfigError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


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
def copy_times_s(nbytes: int, tries: int = 5) -> list[float]:
    """Seconds of `dst.copy_(src)` over `nbytes`; the first copy (page faults) is not timed."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(tries):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return times


def make_engine(model_path: str, s: DecodeBenchSettings) -> LLMEngine:
    """One engine for every run: the budget fits the biggest prefill in one step (no chunking)."""
    max_b = max(s.batch_sizes)
    per_seq = -(-(s.prompt_tokens + s.new_tokens + 1) // BLOCK_SIZE_TOKENS)
    num_blocks = max(max_b * per_seq, -(-(s.prefill_tokens + 1) // BLOCK_SIZE_TOKENS)) + max_b
    return LLMEngine(EngineConfig(
        model_path, dtype=s.dtype,
        cache=CacheConfig(block_size_tokens=BLOCK_SIZE_TOKENS, num_blocks=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_b, max_num_batched_tokens=max(
            max_b * s.prompt_tokens, s.prefill_tokens))))


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


def load_hf(model_path: str, dtype: str) -> Any:
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
    return model.eval()


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
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, num_beams=1,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=pad_id)
        dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + n, (tuple(out.shape), ids.shape, n)
    return dt


def hf_prefill_s(model: Any, prompt: list[int]) -> float:
    """Seconds of one forward over the prompt with the cache on and only the last row's logits,
    which is the work `generate` does for its first token and the engine does in its step."""
    ids = torch.tensor([prompt], dtype=torch.long)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
        return time.perf_counter() - t0


def _pad_id(model: Any) -> int:
    gc = model.generation_config
    for cand in (gc.pad_token_id, gc.eos_token_id, 0):
        if isinstance(cand, (list, tuple)):
            cand = cand[0] if cand else None
        if cand is not None:
            return int(cand)
    return 0


def _with_torch_attention(fn: Any, *args: Any) -> Any:
    """fn(*args) with the engine's decode attention on the PyTorch reference (decided per step)."""
    old = os.environ.get("PDSERVE_PAGED_ATTN")
    os.environ["PDSERVE_PAGED_ATTN"] = "torch"
    try:
        return fn(*args)
    finally:
        if old is None:
            del os.environ["PDSERVE_PAGED_ATTN"]
        else:
            os.environ["PDSERVE_PAGED_ATTN"] = old


# ---- one run --------------------------------------------------------------------------------------
def run_decode_bench(model_path: str, batch_sizes: tuple[int, ...] = (1, 8, 32),
                     prompt_tokens: int = 128, new_tokens: int = 64, prefill_tokens: int = 2048,
                     dtype: str = "float32", repeats: int = 3, progress: bool = True,
                     copy_bytes: int = 512 << 20, attention_baseline: bool = False
                     ) -> dict[str, Any]:
    """Measure everything once and return the result document (see `summarize`).

    Per batch size, each repeat runs engine, `generate(N + 1)`, `generate(1)` back to back, so a
    burst of other work on the machine lands on both sides; repeat 0 is the warm-up and dropped.
    """
    s = DecodeBenchSettings(tuple(batch_sizes), prompt_tokens, new_tokens, prefill_tokens, dtype,
                            repeats, copy_bytes, attention_baseline)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    runs = 2 + 2 + (1 + s.repeats) * ((3 + s.attention_baseline) * len(s.batch_sizes) + 2)
    bar = Progress(TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not progress)
    started = time.perf_counter()
    load_start = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    with bar:
        task = bar.add_task("loading engine", total=runs)

        def tick(what: str) -> None:
            bar.update(task, advance=1, description=what)

        engine = make_engine(model_path, s)
        tick("loading transformers")
        hf = load_hf(model_path, dtype)
        tick("copy bandwidth")
        pad_id = _pad_id(hf)
        max_b = max(s.batch_sizes)
        prompts, source = make_prompts(model_path, [prompt_tokens] * max_b + [prefill_tokens],
                                       engine.model_config.vocab_size)
        long_prompt, prompts = prompts[-1], prompts[:-1]
        copies = copy_times_s(s.copy_bytes)
        tick("decode")
        salt = iter(range(1 << 30))
        decode = []
        for b in s.batch_sizes:
            ids, mask = left_pad(prompts[:b], pad_id)
            raw: dict[str, list[float]] = {"engine_s": [], "generate_s": [], "generate_one_s": []}
            for r in range(1 + s.repeats):  # r == 0 warms both sides up and is dropped
                tick(f"decode B={b} engine {r}/{s.repeats}")
                if s.attention_baseline:
                    tick(f"decode B={b} engine, torch attention {r}/{s.repeats}")
                    both = [lambda: engine_decode_s(engine, prompts[:b], new_tokens,
                                                    f"bench-{next(salt)}"),
                            lambda: _with_torch_attention(engine_decode_s, engine, prompts[:b],
                                                          new_tokens, f"bench-{next(salt)}")]
                    order = (1, 0) if r % 2 else (0, 1)  # which goes first alternates
                    times = {i: both[i]() for i in order}
                    e, e_ref = times[0], times[1]
                    if r:
                        raw.setdefault("engine_torch_attention_s", []).append(e_ref)
                else:
                    e = engine_decode_s(engine, prompts[:b], new_tokens, f"bench-{next(salt)}")
                tick(f"decode B={b} transformers {r}/{s.repeats}")
                full = hf_generate_s(hf, ids, mask, new_tokens + 1, pad_id)
                tick(f"decode B={b} transformers 1 {r}/{s.repeats}")
                one = hf_generate_s(hf, ids, mask, 1, pad_id)
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
        copies += copy_times_s(s.copy_bytes)  # again at the end: the best of both phases counts
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
        "wall_s": time.perf_counter() - started,
    }
    return summarize(s, setup, copies, decode, pre)


def summarize(s: DecodeBenchSettings, setup: dict[str, Any], copy_s: list[float],
              decode: list[tuple[int, dict[str, list[float]]]],
              prefill: dict[str, list[float]]) -> dict[str, Any]:
    """The result document from raw times: pure (no clock, no I/O)."""
    # STREAM's convention: a copy of N bytes moves 2N (it reads N and writes N). The bound
    # below is then an upper bound on what a step that only reads its weights can reach.
    bandwidth = 2 * s.copy_bytes / min(copy_s)
    weight_bytes = setup["weight_bytes"]
    rows = []
    for b, raw in decode:
        hf_decode = [f - o for f, o in zip(raw["generate_s"], raw["generate_one_s"])]
        hf_s, eng_s = statistics.median(hf_decode), statistics.median(raw["engine_s"])
        if hf_s <= 0:
            raise BenchError(f"transformers decode time at batch {b} is {hf_s:.4f} s: the noise "
                             "is larger than the decode; raise --new-tokens or --repeats")
        eng, hf = b * s.new_tokens / eng_s, b * s.new_tokens / hf_s
        bound = b * bandwidth / weight_bytes
        rows.append({
            "batch_size": b,
            "engine": {"decode_s": raw["engine_s"], "median_s": eng_s, "tokens_per_s": eng},
            "transformers": {"generate_s": raw["generate_s"], "generate_one_s": raw["generate_one_s"],
                             "decode_s": hf_decode, "median_s": hf_s, "tokens_per_s": hf},
            "ratio": eng / hf,
            "bound_tokens_per_s": bound,
            "engine_fraction_of_bound": eng / bound,
        })
        if "engine_torch_attention_s" in raw:
            ref_s = statistics.median(raw["engine_torch_attention_s"])
            rows[-1]["engine_torch_attention"] = {
                "decode_s": raw["engine_torch_attention_s"], "median_s": ref_s,
                "tokens_per_s": b * s.new_tokens / ref_s}
            rows[-1]["attention_kernel_gain"] = ref_s / eng_s
    eng_p, hf_p = statistics.median(prefill["engine_s"]), statistics.median(prefill["transformers_s"])
    prefill_doc = {
        "prompt_tokens": s.prefill_tokens,
        "max_num_batched_tokens": setup["max_num_batched_tokens"],
        "engine_steps": setup["engine_prefill_steps"],
        "engine": {"times_s": prefill["engine_s"], "median_s": eng_p,
                   "tokens_per_s": s.prefill_tokens / eng_p},
        "transformers": {"times_s": prefill["transformers_s"], "median_s": hf_p,
                         "tokens_per_s": s.prefill_tokens / hf_p},
        "ratio": hf_p / eng_p,
    }
    by_b = {r["batch_size"]: r["ratio"] for r in rows}
    aims: dict[str, Any] = {}
    for name, (b, aim) in AIMS.items():
        got = by_b.get(b)
        aims[name] = aim
        aims[f"{name}_measured"] = got
        aims[f"{name}_met"] = None if got is None else got >= aim  # None: batch not measured
    return {
        "bench": "decode",
        "machine": {
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "processor": platform.processor() or None,
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": setup["transformers_version"], "device": "cpu",
            # Other work on the box shows at the start (the end counts this run's own threads);
            # with it, torch's threads stall each other and the times spread widely.
            "loadavg_1m_start": setup["loadavg_1m_start"],
            "loadavg_1m_end": setup["loadavg_1m_end"],
            # The engine's decode attention: the C paged kernel or the PyTorch reference.
            "decode_attention": setup.get("decode_attention"),
        },
        "model": {"path": setup["model_path"], "dtype": s.dtype, "weight_bytes": weight_bytes},
        "settings": {**asdict(s), "batch_sizes": list(s.batch_sizes),
                     "decoded_tokens_per_seq": s.new_tokens,
                     "prompt_source": setup["prompt_source"],
                     "max_num_batched_tokens": setup["max_num_batched_tokens"],
                     "num_blocks": setup["num_blocks"],
                     "block_size_tokens": setup["block_size_tokens"]},
        "bandwidth": {"copy_bytes": s.copy_bytes, "copy_s": copy_s, "bytes_per_s": bandwidth,
                      "convention": "read + write bytes of the copy (STREAM)"},
        "decode": rows,
        "prefill": prefill_doc,
        "aims": aims,
        "wall_s": setup["wall_s"],
    }


# ---- output -------------------------------------------------------------------------------------
def print_table(result: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    t = Table(title=f"decode, {result['model']['dtype']}, "
                    f"{result['machine']['torch_threads']} torch threads")
    # "HF" is transformers `generate`; "ratio" is engine/HF; "of bound" is engine/bound.
    # "ref attn" is the engine with PDSERVE_PAGED_ATTN=torch; "kernel" is engine / ref attn.
    gain = any("attention_kernel_gain" in r for r in result["decode"])
    for col in ("batch", "engine tok/s", "HF tok/s", "ratio", "bound tok/s", "of bound",
                *(("ref attn tok/s", "kernel") if gain else ())):
        t.add_column(col, justify="right")
    for r in result["decode"]:
        extra = (f"{r['engine_torch_attention']['tokens_per_s']:.1f}",
                 f"{r['attention_kernel_gain']:.2f}x") if gain else ()
        t.add_row(str(r["batch_size"]), f"{r['engine']['tokens_per_s']:.1f}",
                  f"{r['transformers']['tokens_per_s']:.1f}", f"{r['ratio']:.2f}x",
                  f"{r['bound_tokens_per_s']:.1f}", f"{r['engine_fraction_of_bound']:.0%}", *extra)
    console.print(t)
    p = result["prefill"]
    console.print(f"prefill {p['prompt_tokens']} tokens (budget {p['max_num_batched_tokens']}): "
                  f"engine {p['engine']['tokens_per_s']:.0f} tok/s, transformers "
                  f"{p['transformers']['tokens_per_s']:.0f} tok/s, ratio {p['ratio']:.2f}x")
    console.print(f"copy bandwidth {result['bandwidth']['bytes_per_s'] / 1e9:.2f} GB/s, weights "
                  f"{result['model']['weight_bytes'] / 2**20:.0f} MiB")
    att = result["machine"].get("decode_attention")
    if att:
        how = (f"C paged kernel ({att['isa']}, {'OpenMP' if att['openmp'] else 'one thread'})"
               if att["path"] == "c" else f"PyTorch reference ({att['reason']})")
        console.print(f"decode attention: {how}")
    for name, (b, aim) in AIMS.items():
        met = result["aims"][f"{name}_met"]
        status = "not measured" if met is None else ("met" if met else "not met")
        console.print(f"aim: engine/transformers >= {aim} at batch {b}: {status}")


def write_outputs(result: dict[str, Any], out_dir: str) -> list[str]:
    from matplotlib.figure import Figure

    os.makedirs(out_dir, exist_ok=True)
    json_path, png_path = os.path.join(out_dir, "decode.json"), os.path.join(out_dir, "decode.png")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    bs = [r["batch_size"] for r in result["decode"]]
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.plot(bs, [r["engine"]["tokens_per_s"] for r in result["decode"]], "o-", label="pdserve engine")
    if all("engine_torch_attention" in r for r in result["decode"]):
        ax.plot(bs, [r["engine_torch_attention"]["tokens_per_s"] for r in result["decode"]], "o:",
                label="pdserve engine, PyTorch decode attention")
    ax.plot(bs, [r["transformers"]["tokens_per_s"] for r in result["decode"]], "s-",
            label="transformers generate")
    ax.plot(bs, [r["bound_tokens_per_s"] for r in result["decode"]], "k--",
            label="bandwidth bound (B x copy GB/s / weight bytes)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s")
    ax.set_title(f"{os.path.basename(result['model']['path'])}, {result['model']['dtype']}, "
                 f"{result['machine']['torch_threads']} threads")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.savefig(png_path, dpi=120)
    return [json_path, png_path]


# ---- CLI ----------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    d = DecodeBenchSettings()
    parser.add_argument("--model", help="HF folder or .gguf file (default: SmolLM2-135M GGUF)")
    parser.add_argument("--batch-sizes", type=number_list("--batch-sizes"),
                        default=d.batch_sizes,
                        help="comma-separated (default 1,8,32)")
    parser.add_argument("--prompt-tokens", type=int, default=d.prompt_tokens)
    parser.add_argument("--new-tokens", type=int, default=d.new_tokens)
    parser.add_argument("--prefill-tokens", type=int, default=d.prefill_tokens)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype)
    parser.add_argument("--repeats", type=int, default=d.repeats, help="timed runs per figure")
    parser.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    parser.add_argument("--out", metavar="DIR", help="also write DIR/decode.json and DIR/decode.png")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run for tests: batch 1,2; 16+8 tokens; 64 prefill; 1 repeat")
    parser.add_argument("--threads", type=int, help="torch threads (default: leave as is)")
    parser.add_argument("--attention-baseline", action="store_true",
                        help="also time the engine with PDSERVE_PAGED_ATTN=torch (the PyTorch "
                             "reference decode attention) in the same run")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return parser


def run(args: argparse.Namespace) -> int:
    if args.model is None:
        from pdserve.engine.loader import default_model_path
        args.model = default_model_path()
    if args.threads is not None and args.threads <= 0:
        print(f"pdserve bench decode: --threads must be positive, got {args.threads}",
              file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    q = QUICK
    sizes = dict(batch_sizes=q.batch_sizes, prompt_tokens=q.prompt_tokens,
                 new_tokens=q.new_tokens, prefill_tokens=q.prefill_tokens, repeats=q.repeats,
                 copy_bytes=q.copy_bytes) if args.quick else dict(
        batch_sizes=args.batch_sizes, prompt_tokens=args.prompt_tokens,
        new_tokens=args.new_tokens, prefill_tokens=args.prefill_tokens, repeats=args.repeats)
    try:
        result = run_decode_bench(args.model, dtype=args.dtype, progress=not args.no_progress,
                                  attention_baseline=args.attention_baseline, **sizes)
    except BenchConfigError as e:
        print(f"pdserve bench decode: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)  # in-process callers (tests) get their setting back
    return emit(result, json_out=args.json, out_dir=args.out, write_outputs=write_outputs,
                print_tables=print_table)


def main(argv: list[str] | None = None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="pdserve bench decode", description=__doc__.split("\n", 1)[0]))
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
