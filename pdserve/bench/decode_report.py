"""The results of `pdserve bench decode`: the document, the table and the plot.

Owns turning one run's raw timings into the result document (`summarize`: tokens/s, ratios to
`transformers` and to the bandwidth bound, the aims as met or not), its table, and its JSON and
PNG files. Must not measure anything.
"""

from __future__ import annotations

import os
import platform
import statistics
from dataclasses import asdict
from typing import Any

import torch

from pdserve.output import write_json
from pdserve.engine.device import stated_bandwidth

AIMS = {"aim_ratio_b1": (1, 1.5), "aim_ratio_b32": (32, 2.0)}  # name: (batch size, engine/HF)


class BenchError(RuntimeError):
    """A measurement came out unusable (e.g. noise larger than the thing measured)."""


def summarize(s: "DecodeBenchSettings", setup: dict[str, Any], copy_s: list[float],
              decode: list[tuple[int, dict[str, list[float]]]],
              prefill: dict[str, list[float]]) -> dict[str, Any]:
    """The result document from raw times: pure (no clock, no I/O)."""
    # STREAM's convention: a copy of N bytes moves 2N (it reads N and writes N). The bound
    # below is then an upper bound on what a step that only reads its weights can reach.
    bandwidth = 2 * s.copy_bytes / min(copy_s)
    weight_bytes = setup["weight_bytes"]
    kv_bpt = setup.get("kv_bytes_per_token", 0)
    stated = stated_bandwidth(setup.get("device_name", "cpu"))  # a GPU's data-sheet HBM bytes/s
    rows = []
    for b, raw in decode:
        hf_decode = [f - o for f, o in zip(raw["generate_s"], raw["generate_one_s"])]
        hf_s, eng_s = statistics.median(hf_decode), statistics.median(raw["engine_s"])
        if hf_s <= 0:
            raise BenchError(f"transformers decode time at batch {b} is {hf_s:.4f} s: the noise "
                             "is larger than the decode; raise --new-tokens or --repeats")
        eng, hf = b * s.new_tokens / eng_s, b * s.new_tokens / hf_s
        bound = b * bandwidth / weight_bytes
        # A step also reads every sequence's KV (mean context over the timed steps).
        step_bytes = weight_bytes + b * (s.prompt_tokens + s.new_tokens / 2) * kv_bpt
        rows.append({
            "batch_size": b,
            "engine": {"decode_s": raw["engine_s"], "median_s": eng_s, "tokens_per_s": eng},
            "transformers": {"generate_s": raw["generate_s"], "generate_one_s": raw["generate_one_s"],
                             "decode_s": hf_decode, "median_s": hf_s, "tokens_per_s": hf},
            "ratio": eng / hf,
            "bound_tokens_per_s": bound,
            "engine_fraction_of_bound": eng / bound,
            "bound_with_kv_tokens_per_s": b * bandwidth / step_bytes,
            **({"stated_bound_tokens_per_s": b * stated / step_bytes,
                "engine_fraction_of_stated_bound": eng / (b * stated / step_bytes)}
               if stated else {}),
        })
        for key, name, gain in (("engine_torch_attention_s", "engine_torch_attention",
                                 "attention_kernel_gain"),
                                ("engine_onednn_linear_s", "engine_onednn_linear",
                                 "linear_kernel_gain")):
            if key in raw:
                ref_s = statistics.median(raw[key])
                rows[-1][name] = {"decode_s": raw[key], "median_s": ref_s,
                                  "tokens_per_s": b * s.new_tokens / ref_s}
                rows[-1][gain] = ref_s / eng_s
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
            "transformers": setup["transformers_version"], "device": s.device,
            "device_name": setup.get("device_name", "cpu"),
            # Other work on the box shows at the start (the end counts this run's own threads);
            # with it, torch's threads stall each other and the times spread widely.
            "loadavg_1m_start": setup["loadavg_1m_start"],
            "loadavg_1m_end": setup["loadavg_1m_end"],
            # The engine's decode attention: the C paged kernel or the PyTorch reference.
            "decode_attention": setup.get("decode_attention"),
            # The linear layers' path, and the --linear-baseline engine's.
            "linear": setup.get("linear"),
            **({"linear_isa": setup["linear_isa"]} if "linear_isa" in setup else {}),
            "linear_baseline": setup.get("linear_baseline"),
        },
        "model": {"path": setup["model_path"], "dtype": s.dtype, "quantization": s.quantization,
                  "weight_bytes": weight_bytes},
        "settings": {**asdict(s), "batch_sizes": list(s.batch_sizes),
                     "decoded_tokens_per_seq": s.new_tokens,
                     "prompt_source": setup["prompt_source"],
                     "max_num_batched_tokens": setup["max_num_batched_tokens"],
                     "num_blocks": setup["num_blocks"],
                     "block_size_tokens": setup["block_size_tokens"]},
        "bandwidth": {"copy_bytes": s.copy_bytes, "copy_s": copy_s, "bytes_per_s": bandwidth,
                      "convention": "read + write bytes of the copy (STREAM)",
                      "stated_bytes_per_s": stated},
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
    # "ref attn" is the engine with PDSERVE_PAGED_ATTN=torch; "kernel" is engine / ref attn;
    # "oneDNN lin" the engine with PDSERVE_LINEAR=onednn; "linear" is engine / oneDNN lin.
    gain = any("attention_kernel_gain" in r for r in result["decode"])
    lin = any("linear_kernel_gain" in r for r in result["decode"])
    for col in ("batch", "engine tok/s", "HF tok/s", "ratio", "bound tok/s", "of bound",
                *(("ref attn tok/s", "kernel") if gain else ()),
                *(("oneDNN lin tok/s", "linear") if lin else ())):
        t.add_column(col, justify="right")
    for r in result["decode"]:
        extra = ((f"{r['engine_torch_attention']['tokens_per_s']:.1f}",
                  f"{r['attention_kernel_gain']:.2f}x") if gain else ()) + (
                 (f"{r['engine_onednn_linear']['tokens_per_s']:.1f}",
                  f"{r['linear_kernel_gain']:.2f}x") if lin else ())
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

    json_path = write_json(result, out_dir, "decode.json")
    png_path = os.path.join(out_dir, "decode.png")
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
