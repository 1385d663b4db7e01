"""What vidur reads, written from our side so that it runs with no network: its compute-profile
and network-profile datasets laid out as a Hugging Face hub cache, an attention profile written
from our roofline in vidur's columns, and a trace in vidur's trace-replay columns.

Owns (1) `attention_rows`: per-layer attention times in vidur's `attention.csv` format (one row
per decode batch x context, and per prefill chunk x context), computed from a `StepProfile`'s
roofline terms: prefill attention max(pairs x FLOPs per pair, KV tokens read x bytes per token),
decode attention max(context FLOPs, context KV read), each divided over the layers, in ms; the
new tokens' KV write (`attn_kv_cache_save`) is 0 because the roofline counts those tokens in the
attention's KV read; (2) `write_hub_cache`: vidur's `snapshot_download` calls resolve, with
`HF_HUB_OFFLINE=1`, to a cache folder this writes (`datasets--<org>--<name>/refs/main` naming a
snapshot that holds `config.json` and the `.csv.xz` files), so vidur's installed code runs
unpatched; (3) `write_trace_csv`: our requests as vidur's `Date,Time,PromptTokenCount,
CompletionTokenCount` rows.
Must not download anything, change vidur's installed files, or import vidur (it lives in its own
virtual environment).
"""

from __future__ import annotations

import csv
import io
import json
import lzma
import os
import shutil
from collections.abc import Iterable, Sequence

from pdserve.core.step_profile import StepProfile, attn_pairs

ATTENTION_COLUMNS = ("time_stats.attn_prefill.median", "time_stats.attn_decode.median",
                     "time_stats.attn_kv_cache_save.median", "n_embd", "n_q_head", "n_kv_head",
                     "block_size", "num_tensor_parallel_workers", "max_model_len", "batch_size",
                     "prefill_chunk_size", "kv_cache_size", "is_prefill", "attention_backend")
TRACE_DATE = "2000-01-01"  # vidur's trace replay keeps the rows of one date
SNAPSHOT = "0" * 40  # the commit the hub cache's refs/main names


def attention_rows(profile: StepProfile, layers: int, hidden: int, heads: int, kv_heads: int,
                   block_size: int = 16, max_tokens: int = 4096, granularity: int = 256,
                   max_batch: int = 128, chunk_step: int = 32,
                   kv_includes_chunk: bool = False) -> list[dict]:
    """vidur's attention profile rows from the profile's roofline attention terms. The grid is
    the one vidur predicts on (context in steps of `granularity`, prefill chunks in steps of
    `chunk_step`, every decode batch size up to `max_batch`), so its regression fits points it
    is asked about. A prefill row's `kv_cache_size` is the context before the chunk, as vidur's
    profiler writes it; `kv_includes_chunk` keys it as vidur's simulator looks it up instead
    (the context after the chunk), so that a lookup returns the time of the chunk it means."""
    if layers <= 0:
        raise ValueError(f"layers: must be > 0, got {layers}")
    common = {"n_embd": hidden, "n_q_head": heads, "n_kv_head": kv_heads,
              "block_size": block_size, "num_tensor_parallel_workers": 1,
              "max_model_len": max_tokens, "attention_backend": "pdserve-roofline"}
    contexts = range(0, max_tokens + 1, granularity)
    rows = []
    for b in range(1, max_batch + 1):
        for k in contexts:
            s = max(profile.decode_ctx_s * b * k, profile.kv_read_token_s * b * k) / layers
            rows.append({**common, "time_stats.attn_prefill.median": "",
                         "time_stats.attn_decode.median": s * 1e3,
                         "time_stats.attn_kv_cache_save.median": 0.0,
                         "batch_size": b, "prefill_chunk_size": 0, "kv_cache_size": k,
                         "is_prefill": False})
    for c in range(chunk_step, max_tokens + 1, chunk_step):
        for k in contexts:
            before = max(0, k - c) if kv_includes_chunk else k
            s = max(profile.prefill_attn_s * attn_pairs(c, before),
                    profile.kv_read_token_s * (before + c)) / layers
            rows.append({**common, "time_stats.attn_prefill.median": s * 1e3,
                         "time_stats.attn_decode.median": "",
                         "time_stats.attn_kv_cache_save.median": 0.0,
                         "batch_size": 1, "prefill_chunk_size": c, "kv_cache_size": k,
                         "is_prefill": True})
    return rows


def _csv_text(rows: Iterable[dict], columns: Sequence[str]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    return buf.getvalue()


def write_attention_csv(path: str, rows: list[dict]) -> None:
    """`.csv` or `.csv.xz` (what vidur's datasets hold), by the name's ending."""
    text = _csv_text(rows, ATTENTION_COLUMNS)
    if path.endswith(".xz"):
        with lzma.open(path, "wt") as f:
            f.write(text)
    else:
        with open(path, "w") as f:
            f.write(text)


def _snapshot(cache_dir: str, repo_id: str) -> str:
    org, _, name = repo_id.partition("/")
    if not org or not name or "/" in name:
        raise ValueError(f"repo_id: expected org/name, got {repo_id!r}")
    storage = os.path.join(cache_dir, f"datasets--{org}--{name}")
    os.makedirs(os.path.join(storage, "refs"), exist_ok=True)
    with open(os.path.join(storage, "refs", "main"), "w") as f:
        f.write(SNAPSHOT)
    snap = os.path.join(storage, "snapshots", SNAPSHOT)
    os.makedirs(snap, exist_ok=True)
    return snap


def _xz_copy(src: str, dst: str) -> None:
    if src.endswith(".xz"):
        shutil.copyfile(src, dst)
        return
    with open(src, "rb") as fi, lzma.open(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo)


def write_hub_cache(predictor_cache: str, compute_repo: str, network_repo: str, *,
                    model: str, device: str, network_device: str, mlp_csv: str,
                    attention: list[dict]) -> dict[str, str]:
    """The folders vidur's `snapshot_download(cache_dir=<predictor_cache>/profiling_data/...)`
    finds offline. The network dataset holds empty collective tables (read only with tensor or
    pipeline parallelism, which this configuration does not use)."""
    comp = _snapshot(os.path.join(predictor_cache, "profiling_data", "compute"), compute_repo)
    with open(os.path.join(comp, "config.json"), "w") as f:
        json.dump({"model": model, "device_sku": device,
                   "origin": "mlp.csv: vidur's profile; attention.csv: pdserve roofline"}, f)
    _xz_copy(mlp_csv, os.path.join(comp, "mlp.csv.xz"))
    write_attention_csv(os.path.join(comp, "attention.csv.xz"), attention)
    net = _snapshot(os.path.join(predictor_cache, "profiling_data", "network"), network_repo)
    with open(os.path.join(net, "config.json"), "w") as f:
        json.dump({"sku": network_device}, f)
    cols = "time_stats.{0}.median,size,num_workers,devices_per_node,collective\n"
    for op in ("all_reduce", "send_recv"):
        with lzma.open(os.path.join(net, f"{op}.csv.xz"), "wt") as f:
            f.write(cols.format(op))
    return {"compute": comp, "network": net}


def write_trace_csv(path: str, requests) -> None:
    """Requests (arrival_s, prompt_tokens, output_tokens) as vidur's trace-replay CSV."""
    rows = [{"Date": TRACE_DATE, "Time": r.arrival_s, "PromptTokenCount": r.prompt_tokens,
             "CompletionTokenCount": r.output_tokens} for r in requests]
    with open(path, "w") as f:
        f.write(_csv_text(rows, ("Date", "Time", "PromptTokenCount", "CompletionTokenCount")))
