"""`pdserve bench kvstore --quick` with real processes: the document's shape and arithmetic.

Speed is never asserted (the machines are shared); only that every figure is present and
positive, that each ratio is the quotient of the figures it is built from, and that no hit rate
beats the ideal cache. The bench runs once per module (1 and 4 MiB, 100 batch objects, the first
200 trace requests, internal TLS both: two stores, TCP rows with TLS and without, the shaped
link where this process is root); Redis checks skip only when redis-server is missing, and
Mooncake, UCX and the shaped link are checked either way: measured, or marked unavailable with
their reason and no figures.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shutil
from pathlib import Path

import pytest

from pdserve.bench import kvstore as bench
from pdserve.bench import kvstore_trace as trace

# A slice of the Mooncake conversation trace shipped with the tests (tests/data/README.md), so
# the tests do not depend on the workspace's shared/ folder.
TRACE_FILE = str(Path(__file__).resolve().parents[1] / "data" /
                 "mooncake_conversation_trace_head300.jsonl")

MIB = 1 << 20
SIZES = [1 * MIB, 4 * MIB]
TRACE_REQUESTS = 200


def _positive(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("kvstore-bench")
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = bench.main(["--quick", "--json", "--out", str(out_dir), "--no-progress",
                         "--trace", TRACE_FILE, "--trace-requests", str(TRACE_REQUESTS)])
    assert rc == 0
    doc = json.loads(stdout.getvalue())  # stdout is exactly one JSON document
    return doc, out_dir


def _check_bandwidth_rows(rows: list[dict], raw: bool) -> None:
    assert [r["size_bytes"] for r in rows] == SIZES
    for r in rows:
        for key in ("put_gbps", "get_gbps", "memcpy_gbps", "put_vs_memcpy", "get_vs_memcpy"):
            assert _positive(r[key]), (key, r)
        assert r["put_vs_memcpy"] == pytest.approx(r["put_gbps"] / r["memcpy_gbps"])
        assert r["get_vs_memcpy"] == pytest.approx(r["get_gbps"] / r["memcpy_gbps"])
        if not raw:
            assert len(r["put_s"]) == len(r["get_s"]) == bench.QUICK.repeats
            assert all(_positive(t) for t in r["put_s"] + r["get_s"])
            assert r["put_gbps"] == pytest.approx(r["size_bytes"] / min(r["put_s"]) / 1e9)
            assert r["get_gbps"] == pytest.approx(r["size_bytes"] / min(r["get_s"]) / 1e9)


def test_files_and_settings(run) -> None:
    doc, out_dir = run
    with open(out_dir / "kvstore.json", encoding="utf-8") as f:
        assert json.load(f) == doc
    for name in ("kvstore_bandwidth.png", "kvstore_trace.png", "kvstore_tls.png"):
        png = out_dir / name
        assert png.stat().st_size > 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert doc["bench"] == "kvstore"
    st = doc["settings"]
    assert st["sizes_mib"] == [1, 4] and st["sizes_bytes"] == SIZES
    assert st["repeats"] == bench.QUICK.repeats and st["batch_objects"] == bench.QUICK.batch_objects
    assert st["trace_requests"] == TRACE_REQUESTS and st["trace_scale"] == pytest.approx(1 / 64)
    assert doc["node"]["segment_bytes"] >= 4 * max(SIZES)
    assert "moved once counts N bytes" in doc["conventions"]["gbps"]
    assert _positive(doc["wall_s"]) and doc["machine"]["cpu_count"] >= 1


def test_bandwidth_of_both_transports_and_their_raw_figures(run) -> None:
    doc, _ = run
    series = doc["bandwidth"]["series"]
    assert [r["size_bytes"] for r in series["memcpy"]] == SIZES
    for r in series["memcpy"]:
        assert all(_positive(t) for t in r["times_s"]) and len(r["times_s"]) == bench.QUICK.repeats
        assert r["gbps"] == pytest.approx(r["size_bytes"] / min(r["times_s"]) / 1e9)
    for r, mc in zip(series["crc32"], series["memcpy"]):
        assert _positive(r["gbps"]) and r["vs_memcpy"] == pytest.approx(r["gbps"] / mc["gbps"])
    for name in ("pdserve_shm", "pdserve_tcp"):
        _check_bandwidth_rows(series[name], raw=False)
        for r, mc in zip(series[name], series["memcpy"]):
            assert r["memcpy_gbps"] == pytest.approx(mc["gbps"])  # this run's memcpy
    for name in ("raw_shm", "raw_tcp"):
        _check_bandwidth_rows(series[name], raw=True)


def test_ucx_measured_or_says_why_not(run) -> None:
    doc, _ = run
    if doc["ucx"]["available"]:
        _check_bandwidth_rows(doc["bandwidth"]["series"]["pdserve_ucx"], raw=False)
        assert "ucx_get_vs_mooncake" in doc["aims"]
        assert doc["batch_get"]["systems"]["pdserve_ucx"]["objects_per_s"] > 0
        # UCX has no TLS: a plaintext node of its own serves it; the TCP stores' nodes do not.
        node = doc["ucx"]["processes"][1]["cmdline"]
        assert "--ucx-port" in node and "--insecure-internal" in node
        for procs in doc["internal_tls"]["processes"].values():
            assert "--ucx-port" not in procs[1]["cmdline"]
    else:
        assert "ucxx" in doc["ucx"]["reason"]
        assert "pdserve_ucx" not in doc["bandwidth"]["series"]


def _check_tls_ratios(ratios: list[dict], raw_rows: list[dict], sizes: list[int],
                      rounds: int) -> None:
    assert {(r["system"], r["op"], r["size_bytes"]) for r in ratios} == {
        (s, op, z) for s in ("pdserve_tcp", "raw_tcp") for op in ("get", "put") for z in sizes}
    by_size = {row["size_bytes"]: row for row in raw_rows}
    for r in ratios:
        row, op = by_size[r["size_bytes"]], r["op"] + "_s"
        on, off = row[r["system"] + "_tls"][op], row[r["system"]][op]
        assert len(on) == len(off) == r["rounds"] == rounds
        assert r["tls_gbps"] == pytest.approx(r["size_bytes"] / min(on) / 1e9)
        assert r["plaintext_gbps"] == pytest.approx(r["size_bytes"] / min(off) / 1e9)
        assert r["ratio"] == pytest.approx(r["tls_gbps"] / r["plaintext_gbps"])
        assert sorted(r["round_ratios"]) == pytest.approx(sorted(b / a for a, b in zip(on, off)))
        assert r["round_ratio_min"] <= r["round_ratio_median"] <= r["round_ratio_max"]


def test_internal_tls_both_measures_tcp_with_and_without(run) -> None:
    doc, _ = run
    tls, series = doc["internal_tls"], doc["bandwidth"]["series"]
    assert (tls["mode"], tls["measured"], tls["main"]) == ("both", ["on", "off"], "on")
    assert tls["rounds"] == bench.QUICK.repeats
    for name in ("pdserve_tcp_tls", "pdserve_tcp"):
        _check_bandwidth_rows(series[name], raw=False)
    for name in ("raw_tcp_tls", "raw_tcp"):
        _check_bandwidth_rows(series[name], raw=True)
    raw_rows = [{"size_bytes": a["size_bytes"], **{n: series[n][i] for n in (
        "pdserve_tcp", "pdserve_tcp_tls", "raw_tcp", "raw_tcp_tls")}}
        for i, a in enumerate(series["memcpy"])]
    _check_tls_ratios(tls["ratios"], raw_rows, SIZES, bench.QUICK.repeats)
    assert tls["negotiated"]["version"] in ("TLSv1.2", "TLSv1.3")
    ceiling = tls["crypto_ceiling"]
    assert _positive(ceiling["gbps"]) or ceiling["reason"]
    assert {"pdserve_tcp", "pdserve_tcp_tls"} <= set(doc["batch_get"]["systems"])
    for op in ("get", "put"):
        aim = doc["aims"][f"tls_tcp_{op}_vs_plaintext"]
        mine = [r for r in tls["ratios"] if r["system"] == "pdserve_tcp" and r["op"] == op]
        assert aim["aim"] == 0.9
        assert aim["min"] == pytest.approx(min(r["ratio"] for r in mine))
        assert aim["met"] is (aim["min"] >= 0.9)


def test_the_tls_store_really_ran_with_tls(run) -> None:
    """The command lines the system reports for each store's processes: the TLS store's master
    and node with --tls-dir (the folder made for the run, or this process's), the other's with
    --insecure-internal."""
    doc, _ = run
    procs = doc["internal_tls"]["processes"]
    assert [p["name"] for p in procs["on"]] == ["store (TLS) master", "store (TLS) node"]
    for p in procs["on"]:
        argv = p["cmdline"]
        assert "--tls-dir" in argv and "--insecure-internal" not in argv, argv
        assert os.path.isabs(argv[argv.index("--tls-dir") + 1])
    for p in procs["off"]:
        assert "--insecure-internal" in p["cmdline"] and "--tls-dir" not in p["cmdline"]


def test_shaped_link_measured_or_says_why_not(run) -> None:
    doc, _ = run
    link = doc["internal_tls"]["link"]
    if not link["available"]:
        assert link["reason"] and "ratios" not in link
        assert doc["aims"]["tls_tcp_get_vs_plaintext_link"]["met"] is None
        return
    assert link["rate"] == "10gbit" and link["nominal_gbps"] == pytest.approx(1.25)
    sizes = [z << 20 for z in bench.QUICK.link_sizes_mib]
    assert link["sizes_bytes"] == sizes
    assert link["rounds"] == bench.QUICK.link_rounds
    _check_tls_ratios(link["ratios"], link["times"], sizes, link["rounds"])
    for r in link["ratios"]:
        assert r["plaintext_vs_nominal"] == pytest.approx(r["plaintext_gbps"] / 1.25)
    for p in link["processes"]["on"]:
        assert "--tls-dir" in p["cmdline"]
    node = link["processes"]["off"][1]["cmdline"]
    assert "--insecure-internal" in node and "--data-address" in node


def test_batch_get(run) -> None:
    doc, _ = run
    b = doc["batch_get"]
    assert b["objects"] == bench.QUICK.batch_objects and b["object_bytes"] == 64 * 1024
    assert {"pdserve_shm", "pdserve_tcp"} <= set(b["systems"])
    for v in b["systems"].values():
        assert all(_positive(t) for t in v["times_s"]) and len(v["times_s"]) == b["repeats"]
        assert v["objects_per_s"] == pytest.approx(b["objects"] / min(v["times_s"]))
        assert v["gbps"] == pytest.approx(v["objects_per_s"] * b["object_bytes"] / 1e9)


@pytest.mark.skipif(shutil.which("redis-server") is None,
                    reason="redis-server is not installed (apt-get install redis-server)")
def test_redis_baseline(run) -> None:
    doc, _ = run
    assert doc["redis"]["available"] is True and doc["redis"]["server_version"]
    _check_bandwidth_rows(doc["bandwidth"]["series"]["redis"], raw=False)
    systems = doc["batch_get"]["systems"]
    mget = systems["redis_mget"]["objects_per_s"]
    assert _positive(systems["redis_pipeline"]["objects_per_s"])
    for v in systems.values():
        assert v["vs_redis_mget"] == pytest.approx(v["objects_per_s"] / mget)


def test_mooncake_measured_or_says_why_not(run) -> None:
    doc, _ = run
    mc, series, aims = doc["mooncake"], doc["bandwidth"]["series"], doc["aims"]
    if mc["available"]:
        _check_bandwidth_rows(series["mooncake"], raw=False)
        assert _positive(doc["batch_get"]["systems"]["mooncake"]["objects_per_s"])
        tcp = {r["size_bytes"]: r["get_gbps"] for r in series["pdserve_tcp"]}
        aim = aims["tcp_get_vs_mooncake"]
        for row, m in zip(aim["by_size"], series["mooncake"]):
            assert row["ratio"] == pytest.approx(tcp[row["size_bytes"]] / m["get_gbps"])
        assert aim["met"] is all(r["ratio"] >= 1.0 for r in aim["by_size"])
    else:
        assert isinstance(mc["reason"], str) and mc["reason"]  # the exact error, never numbers
        assert "mooncake" not in series and "mooncake" not in doc["batch_get"]["systems"]
        aim = aims["tcp_get_vs_mooncake"]
        assert aim["met"] is None and aim["reference_gbps"] == 2.5 and mc["reason"] in aim["note"]


def test_aims_are_reported_from_the_figures(run) -> None:
    doc, _ = run
    series, aims = doc["bandwidth"]["series"], doc["aims"]
    for name, src in (("shm_get_vs_memcpy", "pdserve_shm"), ("shm_raw_get_vs_memcpy", "raw_shm")):
        aim = aims[name]
        assert aim["aim"] == 0.5
        assert [r["ratio"] for r in aim["by_size"]] == pytest.approx(
            [r["get_vs_memcpy"] for r in series[src]])
        assert aim["min"] == pytest.approx(min(r["get_vs_memcpy"] for r in series[src]))
        assert aim["met"] is (aim["min"] >= 0.5)


def test_trace_hit_rates_never_beat_the_ideal(run) -> None:
    doc, _ = run
    tr = doc["trace"]
    assert tr["requests"] == TRACE_REQUESTS and tr["path"].endswith(".jsonl")
    assert tr["total_blocks"] > 0 and 0 < tr["ideal_hit_blocks"] < tr["total_blocks"]
    assert tr["ideal_hit_rate"] == pytest.approx(tr["ideal_hit_blocks"] / tr["total_blocks"])
    assert tr["object_bytes"] == round(tr["full_block_bytes"] * tr["scale"]) == MIB
    assert "Apache-2.0" in tr["attribution"]
    assert [r["capacity_blocks"] for r in tr["capacities"]] == list(bench.QUICK.capacity_blocks)
    for r in tr["capacities"]:
        assert 0 <= r["hit_blocks"] <= tr["ideal_hit_blocks"]
        assert 0 <= r["lru_hit_blocks"] <= tr["ideal_hit_blocks"]
        assert r["hit_rate"] == pytest.approx(r["hit_blocks"] / tr["total_blocks"])
        assert r["hit_rate"] <= tr["ideal_hit_rate"]
        assert r["vs_ideal"] == pytest.approx(r["hit_rate"] / tr["ideal_hit_rate"])
        assert r["capacity_bytes"] == r["capacity_blocks"] * MIB
        assert r["puts"] + r["put_already_stored"] + r["put_no_space"] + r["hit_blocks"] == \
            r["total_blocks"]
    # Every block of the first 200 requests fits the largest capacity: it is the ideal cache.
    assert tr["capacities"][-1]["hit_blocks"] == tr["ideal_hit_blocks"]


def test_replay_counts_prefix_hits_exactly() -> None:
    reqs = [(0.0, ["a", "b"]), (1.0, ["a", "b", "c"]), (2.0, ["a", "d"]), (3.0, ["x", "b"])]
    assert trace.ideal_hits(reqs) == (3, 9)  # 0 + 2 + 1 + 0: "b" after a miss does not count
    got = trace.replay(reqs, capacity_blocks=100, object_bytes=4096)
    assert (got["hit_blocks"], got["total_blocks"], got["puts"]) == (3, 9, 5)
    assert got["put_already_stored"] == 1  # "b" behind the missing "x"
    assert trace.lru_hits(reqs, 100) == 3 and trace.lru_hits(reqs, 1) == 0


def test_bad_settings_name_the_field(capsys) -> None:
    assert bench.main(["--sizes", "0,4", "--no-progress"]) == 2
    assert "sizes_mib" in capsys.readouterr().err
    assert bench.main(["--quick", "--trace", "/nonexistent/trace.jsonl", "--no-progress"]) == 2
    assert "/nonexistent/trace.jsonl" in capsys.readouterr().err
    assert bench.main(["--trace-scale", "2", "--no-progress"]) == 2
    assert "trace_scale" in capsys.readouterr().err
    assert bench.main(["--internal-tls", "yes", "--no-progress"]) == 2
    assert "--internal-tls must be one of on, off, both, got 'yes'" in capsys.readouterr().err
    assert bench.main(["--link-rate", "10gb", "--no-progress"]) == 2
    assert "--link-rate" in capsys.readouterr().err
    args = bench.add_arguments(__import__("argparse").ArgumentParser()).parse_args(
        ["--quick", "--trace-scale", "1/32", "--sizes", "2"])
    s = bench.settings_from_args(args)
    assert s.trace_scale == pytest.approx(1 / 32) and s.sizes_mib == (2,)
    assert s.repeats == bench.QUICK.repeats  # the quick preset fills what was not given


def test_without_baselines_the_table_says_why(tmp_path, capsys) -> None:
    """Also internal TLS on alone: TCP only with TLS, no UCX (it has none), no ratio."""
    rc = bench.main(["--quick", "--no-redis", "--no-mooncake", "--sizes", "1",
                     "--batch-objects", "20", "--trace", TRACE_FILE, "--trace-requests", "50",
                     "--capacity-blocks", "64", "--internal-tls", "on", "--link-rate", "off",
                     "--no-progress", "--out", str(tmp_path)])
    assert rc == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "mooncake: not measured: disabled with --no-mooncake" in out
    assert "redis: not measured: disabled with --no-redis" in out
    assert "aim tcp_get_vs_mooncake >= 1.0: not measured" in out
    assert "shaped link: not measured: disabled with --link-rate off" in out
    assert "aim tls_tcp_get_vs_plaintext >= 0.9: not measured" in out
    doc = json.loads((tmp_path / "kvstore.json").read_text())
    assert doc["redis"] == {"available": False, "reason": "disabled with --no-redis"}
    assert "redis" not in doc["bandwidth"]["series"]
    assert doc["aims"]["tcp_get_vs_mooncake"]["met"] is None
    assert all(v["vs_redis_mget"] is None for v in doc["batch_get"]["systems"].values())
    assert (tmp_path / "kvstore_bandwidth.png").stat().st_size > 0
    tls, series = doc["internal_tls"], doc["bandwidth"]["series"]
    assert tls["measured"] == ["on"] and tls["ratios"] == []
    assert {"pdserve_tcp_tls", "raw_tcp_tls"} <= set(series)
    assert not {"pdserve_tcp", "raw_tcp", "pdserve_ucx"} & set(series)
    assert doc["ucx"]["available"] is False
    assert "plaintext" in doc["ucx"]["reason"] or "ucxx" in doc["ucx"]["reason"]
    assert all("--tls-dir" in p["cmdline"] for p in tls["processes"]["on"])
    assert not (tmp_path / "kvstore_tls.png").exists()
