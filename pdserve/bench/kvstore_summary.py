"""The result document of `pdserve bench kvstore`, made from raw times: pure (no clock, no I/O).

Owns the figures (best-of GB/s, objects/s, hit rates), every ratio against its same-run baseline
(internal TLS against plaintext over TCP too, on loopback and over the shaped link, with each
round's ratio for the spread), the conventions stated beside them, and the aims with whether
they were met (reported, never asserted). Must not measure anything.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from pdserve.bench.kvstore_trace import BLOCK_TOKENS, FULL_BLOCK_BYTES, KV_BYTES_PER_TOKEN
from pdserve.kvstore.master.config import MasterConfig

AIM_SHM_VS_MEMCPY = 0.5
AIM_TCP_VS_MOONCAKE = 1.0
AIM_TLS_VS_PLAINTEXT = 0.9  # internal TLS may cost at most 10% of the TCP store's bandwidth
MOONCAKE_TCP_REFERENCE_GBPS = 2.5  # the figure for Mooncake get_into over TCP here

CONVENTIONS = {
    "gbps": "1e9 bytes per second; an object of N bytes moved once counts N bytes (the memcpy "
            "baseline too: not STREAM's read + write 2N)",
    "best_of": "each figure is the best (shortest) of `repeats` timed runs; every time is kept",
    "ratios": "every ratio is between two figures measured in this run on this machine",
    "pdserve": "DistStoreClient end to end: master round trips (PutStart + PutCommit, or Get) and "
               "one checksum (xxh3) over the object (computed on put, verified on get) included",
    "raw": "pdserve.kvstore.transport.measure: the transport alone against an extent reserved "
           "through the master (no master calls, no crc32), beside its own memcpy",
    "redis": "redis-py SET from a memoryview and GET returning a new bytes object (the copy out "
             "of the socket included) against a private redis-server on loopback",
    "mooncake": "MooncakeDistributedStore put_from / get_into of registered buffers, protocol "
                "tcp, the segment in another process",
    "batch": "objects per second getting every object of the batch once; DistStoreClient has no "
             "batch get, so it is one get_into (one master round trip) per object",
    "internal_tls": "with --internal-tls both, the TCP rows (raw and end to end) run against two "
                    "stores, one with mutual TLS and one with --insecure-internal, in `rounds` "
                    "rounds of one timed operation each, the order of the two flipped every "
                    "round; the ratio is TLS GB/s / plaintext GB/s of the best of each, the "
                    "spread the median, lowest and highest ratio of one round's pair; the "
                    "shaped link runs its own `link.rounds`; the other rows run once, under "
                    "`main`",
}

SYSTEMS = {  # label, how: for tables and plots
    "pdserve_shm": ("pdserve shm", "DistStoreClient, same host_id as the node: shared memory"),
    "pdserve_tcp": ("pdserve tcp", "DistStoreClient, another host_id: the node's TCP data server"),
    "pdserve_ucx": ("pdserve ucx", "DistStoreClient, another host_id: the node's ucxx listener"),
    "raw_shm": ("raw shm", "ShmTransport write/read_into, no master, no crc32"),
    "raw_tcp": ("raw tcp", "TcpTransport write/read_into, no master, no crc32"),
    "pdserve_tcp_tls": ("pdserve tcp+TLS", "as pdserve tcp, internal mutual TLS on"),
    "raw_tcp_tls": ("raw tcp+TLS", "as raw tcp, internal mutual TLS on"),
    "redis": ("redis", "redis-py SET/GET, redis-server on loopback"),
    "mooncake": ("mooncake", "Mooncake Store put_from/get_into, tcp"),
}
BATCH_SYSTEMS = {
    "pdserve_shm": "pdserve shm (batch_get_into: one master call)",
    "pdserve_tcp": "pdserve tcp (batch_get_into: one master call)",
    "pdserve_tcp_tls": "pdserve tcp+TLS (batch_get_into: one master call)",
    "pdserve_ucx": "pdserve ucx (batch_get_into: one master call)",
    "redis_mget": "redis MGET (one command)",
    "redis_pipeline": "redis pipeline of GETs",
    "mooncake": "Mooncake batch_get_into",
}


def _gbps(size: int, times: list[float]) -> float:
    return size / min(times) / 1e9


def _bandwidth(raw_rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    series: dict[str, list[dict[str, Any]]] = {"memcpy": [], "crc32": []}
    for row in raw_rows:
        size = row["size_bytes"]
        memcpy = _gbps(size, row["memcpy_s"])
        series["memcpy"].append({"size_bytes": size, "times_s": row["memcpy_s"], "gbps": memcpy})
        crc = _gbps(size, row["crc32_s"])
        series["crc32"].append({"size_bytes": size, "times_s": row["crc32_s"], "gbps": crc,
                                "vs_memcpy": crc / memcpy})
        for name in SYSTEMS:
            got = row.get(name)
            if got is None:
                continue
            if "put_gbps" in got:  # measure_bandwidth's row: its own adjacent memcpy
                series.setdefault(name, []).append(dict(got))
                continue
            put, get = _gbps(size, got["put_s"]), _gbps(size, got["get_s"])
            series.setdefault(name, []).append({
                "size_bytes": size, "put_s": got["put_s"], "get_s": got["get_s"],
                "put_gbps": put, "get_gbps": get, "memcpy_gbps": memcpy,
                "put_vs_memcpy": put / memcpy, "get_vs_memcpy": get / memcpy})
    return series


def _batch(s: Any, raw: dict[str, list[float]]) -> dict[str, Any]:
    n, size = s.batch_objects, s.batch_object_bytes
    systems = {name: {"times_s": t, "objects_per_s": n / min(t), "gbps": n * size / min(t) / 1e9,
                      "how": BATCH_SYSTEMS[name]} for name, t in raw.items()}
    base = systems.get("redis_mget")
    for v in systems.values():
        v["vs_redis_mget"] = v["objects_per_s"] / base["objects_per_s"] if base else None
    return {"objects": n, "object_bytes": size, "repeats": s.repeats, "systems": systems}


def _trace(s: Any, raw: dict[str, Any]) -> dict[str, Any]:
    total = raw["total_blocks"]
    ideal = raw["ideal_hit_blocks"] / total if total else 0.0
    rows = []
    for r in raw["capacities"]:
        hit = r["hit_blocks"] / total if total else 0.0
        lru = r["lru_hit_blocks"] / total if total else 0.0
        rows.append({**r, "hit_rate": hit, "lru_hit_rate": lru,
                     "vs_ideal": hit / ideal if ideal else None,
                     "vs_lru": hit / lru if lru else None})
    cfg = MasterConfig()
    return {
        "path": raw["path"], "requests": raw["requests"], "total_blocks": total,
        "unique_blocks": raw["unique_blocks"], "ideal_hit_blocks": raw["ideal_hit_blocks"],
        "ideal_hit_rate": ideal,
        "attribution": "Mooncake (FAST '25) release traces, conversation workload, Apache-2.0",
        "block_tokens": BLOCK_TOKENS, "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "full_block_bytes": FULL_BLOCK_BYTES, "scale": s.trace_scale,
        "object_bytes": raw["object_bytes"],
        "scale_note": "object bytes = scale x full block bytes (512 tokens of Llama-3-8B fp16 KV); "
                      "the scale changes bytes only, not capacities in blocks or hit rates",
        "replay": "MasterCore, one node; per request longest_prefix, get of the hit blocks (the "
                  "worker's read), put_start + put_commit of the missing ones; timestamps as now_s",
        "master_config": {"high_watermark": cfg.high_watermark, "low_watermark": cfg.low_watermark,
                          "eviction_sample": cfg.eviction_sample, "lease_s": cfg.lease_s},
        "capacities": rows,
    }


def tls_ratios(raw_rows: list[dict[str, Any]], ceiling_gbps: float | None = None
               ) -> list[dict[str, Any]]:
    """Per size, system (raw_tcp, pdserve_tcp) and op: TLS and plaintext GB/s (best of the
    rounds), their ratio, and each round's ratio (its TLS run against its plaintext run)."""
    out = []
    for row in raw_rows:
        size = row["size_bytes"]
        for name in ("pdserve_tcp", "raw_tcp"):
            on, off = row.get(name + "_tls"), row.get(name)
            if on is None or off is None:
                continue
            for op in ("get", "put"):
                t_on, t_off = on[op + "_s"], off[op + "_s"]
                rounds = sorted(b / a for a, b in zip(t_on, t_off))
                tls_gbps = _gbps(size, t_on)
                out.append({
                    "system": name, "op": op, "size_bytes": size, "tls_gbps": tls_gbps,
                    "plaintext_gbps": _gbps(size, t_off), "ratio": min(t_off) / min(t_on),
                    "rounds": len(rounds), "round_ratios": rounds,
                    "round_ratio_median": rounds[len(rounds) // 2] if len(rounds) % 2
                    else (rounds[len(rounds) // 2 - 1] + rounds[len(rounds) // 2]) / 2,
                    "round_ratio_min": rounds[0], "round_ratio_max": rounds[-1],
                    "tls_vs_cipher": tls_gbps / ceiling_gbps if ceiling_gbps else None})
    return out


def _internal_tls(raw: dict[str, Any]) -> dict[str, Any]:
    info = dict(raw.get("internal_tls", {}))
    ceiling = (info.get("crypto_ceiling") or {}).get("gbps")
    info["ratios"] = tls_ratios(raw["bandwidth"], ceiling)
    link = dict(raw.get("link", {"available": False, "reason": "not measured"}))
    if link.get("available"):
        rows = link.pop("rows")
        link["sizes_bytes"] = [r["size_bytes"] for r in rows]
        link["ratios"] = tls_ratios(rows, ceiling)
        for r in link["ratios"]:
            r["plaintext_vs_nominal"] = r["plaintext_gbps"] / link["nominal_gbps"]
            r["tls_vs_nominal"] = r["tls_gbps"] / link["nominal_gbps"]
        link["times"] = rows
    info["link"] = link
    return info


def _tls_aims(tls: dict[str, Any]) -> dict[str, Any]:
    aims = {}
    for where, ratios in (("", tls["ratios"]), ("_link", tls["link"].get("ratios"))):
        for op in ("get", "put"):
            name = f"tls_tcp_{op}_vs_plaintext{where}"
            by_size = [(r["size_bytes"], r["ratio"]) for r in ratios or []
                       if r["system"] == "pdserve_tcp" and r["op"] == op]
            place = (f"over a link shaped to {tls['link'].get('rate')}" if where
                     else "on loopback")
            if by_size:
                aims[name] = _ratio_aim(AIM_TLS_VS_PLAINTEXT, by_size,
                                        f"pdserve tcp {op} with internal TLS / without, "
                                        f"{place}, every size")
            else:
                why = (tls["link"].get("reason") if where and not tls["link"].get("available")
                       else "needs --internal-tls both")
                aims[name] = {"aim": AIM_TLS_VS_PLAINTEXT, "by_size": [], "min": None,
                              "met": None, "note": f"not measured {place}: {why}"}
    return aims


def _ratio_aim(aim: float, by_size: list[tuple[int, float]], figure: str) -> dict[str, Any]:
    ratios = [r for _, r in by_size]
    return {"aim": aim, "figure": figure,
            "by_size": [{"size_bytes": b, "ratio": r} for b, r in by_size],
            "min": min(ratios) if ratios else None,
            "met": all(r >= aim for r in ratios) if ratios else None}


def _aims(series: dict[str, list[dict[str, Any]]], mooncake: dict[str, Any]) -> dict[str, Any]:
    def ratio(num: str, den: str | None) -> list[tuple[int, float]]:
        if den is None:
            return [(r["size_bytes"], r["get_vs_memcpy"]) for r in series.get(num, [])]
        dens = {r["size_bytes"]: r["get_gbps"] for r in series.get(den, [])}
        return [(r["size_bytes"], r["get_gbps"] / dens[r["size_bytes"]])
                for r in series.get(num, []) if r["size_bytes"] in dens]

    aims = {
        "shm_get_vs_memcpy": _ratio_aim(AIM_SHM_VS_MEMCPY, ratio("pdserve_shm", None),
                                        "DistStoreClient get_into over shm / memcpy, every size"),
        "shm_raw_get_vs_memcpy": _ratio_aim(AIM_SHM_VS_MEMCPY, ratio("raw_shm", None),
                                            "ShmTransport read_into / its memcpy, every size"),
    }
    for name, num in (("tcp_get_vs_mooncake", "pdserve_tcp"),
                      ("tcp_raw_get_vs_mooncake", "raw_tcp"),
                      ("ucx_get_vs_mooncake", "pdserve_ucx")):
        if num == "pdserve_ucx" and num not in series:
            continue  # ucxx not installed, or TLS on: the document's "ucx" entry says why
        if num not in series and num + "_tls" in series:
            num += "_tls"  # --internal-tls on: the TCP rows are TLS's
        if "mooncake" in series:
            aims[name] = _ratio_aim(AIM_TCP_VS_MOONCAKE, ratio(num, "mooncake"),
                                    f"{SYSTEMS[num][0]} get / Mooncake get_into, every size")
        else:
            aims[name] = {
                "aim": AIM_TCP_VS_MOONCAKE, "by_size": [], "min": None, "met": None,
                "reference_gbps": MOONCAKE_TCP_REFERENCE_GBPS,
                "note": f"Mooncake not measured in this run ({mooncake.get('reason')}); the "
                        f"issue's reference is ~{MOONCAKE_TCP_REFERENCE_GBPS} GB/s for Mooncake "
                        "get_into over TCP on this machine (not a same-run ratio)"}
    return aims


def summarize(s: Any, machine: dict[str, Any], raw: dict[str, Any],
              wall_s: float) -> dict[str, Any]:
    """The result document from the raw times in `raw` (see kvstore.run_kvstore_bench)."""
    series = _bandwidth(raw["bandwidth"])
    internal_tls = _internal_tls(raw)
    settings = {**asdict(s), "sizes_mib": list(s.sizes_mib), "sizes_bytes": s.sizes_bytes,
                "capacity_blocks": list(s.capacity_blocks), "trace_path": raw["trace"]["path"]}
    return {
        "bench": "kvstore",
        "machine": machine,
        "settings": settings,
        "node": raw["node"],
        "conventions": CONVENTIONS,
        "redis": raw["redis"],
        "mooncake": raw["mooncake"],
        "ucx": raw.get("ucx", {"available": False, "reason": "not measured"}),
        "internal_tls": internal_tls,
        "bandwidth": {"systems": {k: v[1] for k, v in SYSTEMS.items() if k in series},
                      "series": series},
        "batch_get": _batch(s, raw["batch"]),
        "trace": _trace(s, raw["trace"]),
        "aims": {**_aims(series, raw["mooncake"]), **_tls_aims(internal_tls)},
        "wall_s": wall_s,
    }
