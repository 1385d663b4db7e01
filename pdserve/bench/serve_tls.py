"""Internal TLS in `pdserve bench serve`: which passes run, how each cluster is told, and the
comparison of the passes with TLS and without.

`--internal-tls on` (the default) measures what `pdserve serve` does (mutual TLS inside the
cluster); `off` runs it with `--insecure-internal`; `both` runs the same workload and levels on
a cluster with TLS and on one without, `pairs` times, the order flipped every pair (on, off,
off, on, ...) so that a drift of the shared machine hits both alike. Per level it reports output
tokens/s of each setting (mean over its passes), their ratio and each pair's, and the CPU
seconds per output token of the cluster's processes (their whole trees; the bench's client
apart), the figure noise moves least. On one machine the KV moves through shared memory, so
internal TLS costs only the gRPC hops (router <-> workers, stats polls, KV event streams, store
master calls). Pure except `cmdline` (reads /proc): no clock, no sockets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MODES = ("on", "off", "both")
ON, OFF = "on", "off"
AIM_TOKENS_RATIO = 0.97  # at most 3% fewer output tokens/s with internal TLS
AIM_CONCURRENCY = 32
CLIENT = "client"  # serve_probe.CLIENT: the bench's own process


LEVEL_KEYS = ("concurrency", "requests", "ok", "failed", "output_tokens", "wall_s",
              "tokens_per_s", "ttft_p50_s", "itl_p50_s", "tpot_mean_s", "cpu_s",
              "loadavg_1m_start")


def check_mode(mode: str, pairs: int) -> None:
    if mode not in MODES:
        raise ValueError(f"--internal-tls must be one of {', '.join(MODES)}, got {mode!r}")
    if pairs < 1:
        raise ValueError(f"--tls-pairs must be >= 1, got {pairs}")


def pass_order(mode: str, pairs: int) -> list[str]:
    """The settings of the pdserve passes, in order: [mode], or on/off pairs flipped each pair."""
    if mode != "both":
        return [mode]
    out: list[str] = []
    for i in range(pairs):
        out += [ON, OFF] if i % 2 == 0 else [OFF, ON]
    return out


def cluster_setting(mode: str, tls_dir: str | None) -> dict[str, Any]:
    """ClusterSpec fields for a pass: plaintext, or mutual TLS with `tls_dir` (None: as
    `pdserve serve` does, this process's folder or a CA made in the log folder)."""
    if mode == OFF:
        return {"insecure_internal": True}
    return {"tls_dir": tls_dir} if tls_dir else {}


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def tls_flags(argv: Sequence[str]) -> list[str]:
    """The internal-TLS flags in a command line: ["--tls-dir", DIR], ["--insecure-internal"]
    or [] (the setting then came from the environment)."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a == "--insecure-internal":
            out.append(a)
        elif a == "--tls-dir" and i + 1 < len(argv):
            out += [a, argv[i + 1]]
        elif a.startswith("--tls-dir="):
            out += a.split("=", 1)
    return out


def _hop(lv: Mapping[str, Any]) -> float | None:
    """The level's worker -> router seconds per token (the gRPC hop TLS wraps), if measured."""
    for h in (lv.get("hops") or {}).get("hops", ()):
        if h["hop"] == "worker -> router":
            return h["seconds"]
    return None


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def _cpu(levels: Sequence[Mapping[str, Any]]) -> tuple[float | None, float | None]:
    """(cluster CPU s, client CPU s) per output token over `levels` (None without CPU times)."""
    tokens = sum(lv["output_tokens"] for lv in levels)
    if not tokens or any(not lv.get("cpu_s") for lv in levels):
        return None, None
    cluster = sum(v for lv in levels for k, v in lv["cpu_s"].items() if k != CLIENT)
    client = sum(lv["cpu_s"].get(CLIENT, 0.0) for lv in levels)
    return cluster / tokens, client / tokens


def compare(passes: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency: each setting's mean tokens/s, CPU per token, their ratios (TLS / not),
    and the tokens/s ratio of each adjacent on/off pair of passes."""
    levels = [lv["concurrency"] for lv in passes[0]["levels"]]
    rows = []
    for c in levels:
        at = {mode: [lv for p in passes if p["mode"] == mode for lv in p["levels"]
                     if lv["concurrency"] == c] for mode in (ON, OFF)}
        row: dict[str, Any] = {"concurrency": c}
        for mode, lvs in at.items():
            cpu, client = _cpu(lvs)
            row[mode] = {"passes": len(lvs),
                         "tokens_per_s": _mean([lv["tokens_per_s"] for lv in lvs]),
                         "tokens_per_s_each": [lv["tokens_per_s"] for lv in lvs],
                         "failed": sum(lv["failed"] for lv in lvs),
                         "cpu_s_per_token": cpu, "client_cpu_s_per_token": client,
                         "itl_p50_s": _mean([lv["itl_p50_s"] for lv in lvs
                                             if lv["itl_p50_s"] is not None]),
                         "ttft_p50_s": _mean([lv["ttft_p50_s"] for lv in lvs
                                              if lv["ttft_p50_s"] is not None]),
                         "worker_to_router_s": _mean([h for h in map(_hop, lvs)
                                                      if h is not None])}
        pairs = []
        for a, b in zip(passes[::2], passes[1::2]):
            by = {p["mode"]: next((lv for lv in p["levels"] if lv["concurrency"] == c), None)
                  for p in (a, b)}
            if by.get(ON) and by.get(OFF):
                pairs.append(by[ON]["tokens_per_s"] / by[OFF]["tokens_per_s"])
        row["tokens_ratio"] = _ratio(row[ON]["tokens_per_s"], row[OFF]["tokens_per_s"])
        row["pair_ratios"] = pairs
        row["cpu_per_token_ratio"] = _ratio(row[ON]["cpu_s_per_token"],
                                            row[OFF]["cpu_s_per_token"])
        rows.append(row)
    return rows


def summarize(mode: str, order: Sequence[str], passes: Sequence[Mapping[str, Any]],
              tls_dir: str | None) -> dict[str, Any]:
    """The document's `internal_tls` entry: the setting, each pass's processes' TLS flags and,
    with both settings measured, the comparison and the aim (tokens/s at concurrency 32, else
    at the highest level, with TLS >= 0.97x without)."""
    out: dict[str, Any] = {
        "mode": mode, "order": list(order), "tls_dir": tls_dir,
        "passes": [{"mode": p["mode"], "start_s": p["start_s"],
                    "loadavg_1m": [lv["loadavg_1m_start"] for lv in p["levels"]],
                    "flags": {name: tls_flags(argv) for name, argv in p["cmdlines"].items()},
                    "cmdlines": p["cmdlines"],
                    "levels": [{**{k: lv.get(k) for k in LEVEL_KEYS},
                                "worker_to_router_s": _hop(lv)} for lv in p["levels"]]}
                   for p in passes]}
    if mode != "both":
        return out
    rows = compare(passes)
    out["by_level"] = rows
    level = next((r for r in rows if r["concurrency"] == AIM_CONCURRENCY), rows[-1])
    ratio = level["tokens_ratio"]
    out["aim"] = {"aim": AIM_TOKENS_RATIO, "concurrency": level["concurrency"],
                  "figure": "output tokens/s with internal TLS / without (mean over passes)",
                  "ratio": ratio, "pair_ratios": level["pair_ratios"],
                  "met": None if ratio is None else ratio >= AIM_TOKENS_RATIO,
                  **({} if level["concurrency"] == AIM_CONCURRENCY else {
                      "note": f"no concurrency {AIM_CONCURRENCY} level: judged at "
                              f"{level['concurrency']}"})}
    return out
