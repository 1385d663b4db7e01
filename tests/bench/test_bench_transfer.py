"""`pdserve bench transfer --quick` on the tiny random Llama: two real processes, one TCP link.

The emulated link (loopback and a pacer) needs no privileges; a shaped point (network namespaces,
veth, tc tbf) runs only as root with `ip` and `tc`, else skips. No time is asserted (shared
machines); what is: every row is there, (a), (b), (d) give identical tokens, the anchor's share
of the bytes is the codec's, the files are written.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest
import torch

from pdserve.bench import transfer as bench
from pdserve.bench.transfer_proc import VARIANTS
from pdserve.engine import kvcodec


def _run(capsys, *argv: str) -> dict:
    rc = bench.main([*argv, "--json", "--no-progress"])
    assert rc == 0
    return json.loads(capsys.readouterr().out)  # stdout is exactly one JSON document


def _check_rows(doc: dict, points: set[tuple[int, float]]) -> None:
    rows = doc["rows"]
    got = {(r["prompt_tokens"], r["link_gbps"]) for r in rows}
    assert points <= got
    for point in got:
        mine = {r["variant"]: r for r in rows if (r["prompt_tokens"], r["link_gbps"]) == point}
        assert set(mine) == set(VARIANTS)
        a = mine["full-after"]["tokens"]
        assert len(a) == 10
        for v in ("full-after", "full-layerwise", "progressive"):
            assert mine[v]["exact"] and mine[v]["differing_tokens"] == 0
            assert mine[v]["tokens"] == a
        c = mine["int8-layerwise"]
        assert len(c["tokens"]) == 10 and c["differing_tokens"] == sum(
            x != y for x, y in zip(c["tokens"], a))
        d = mine["progressive"]
        if d["fallback_to_layerwise"]:
            assert d["anchor_fraction"] is None
        else:
            assert d["anchor_fraction"] == pytest.approx(kvcodec.anchor_fraction(torch.float32))
        for r in mine.values():
            assert r["regime"] in ("compute-bound", "link-bound", "residual-overlapped")
            assert r["kv_bytes"] > 0 and r["t_10th_s"] >= r["t_2nd_s"]
    assert doc["exact_abd"] is True


def test_quick_emulated_link(tiny_llama_dir: str, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    doc = _run(capsys, "--model", tiny_llama_dir, "--quick", "--link", "emulated", "--out", str(out))
    assert doc["bench"] == "transfer"
    assert doc["link"]["shaped"] is False and "EMULATED" in doc["link"]["description"]
    q = bench.QUICK
    _check_rows(doc, {(n, g) for n in q["prompt_tokens"] for g in q["link_gbps"]})
    # One extra point per size at the rate where (b) waits nine decode steps, with the ratios.
    for size in doc["sizes"]:
        assert size["nine_step_gbps"] > 0 and size["nine_step_gbps_how"]
        assert set(size["ratios_t10"]) == set(size["aims_met"])
        nine = [r for r in doc["rows"] if r["prompt_tokens"] == size["prompt_tokens"]
                and r["nine_step_point"]]
        assert len(nine) == 4 and {r["link_gbps"] for r in nine} == {size["nine_step_gbps"]}
    with open(out / "results.json", encoding="utf-8") as f:
        assert json.load(f) == doc
    png = (out / "transfer.png").read_bytes()
    assert len(png) > 1000 and png[:8] == b"\x89PNG\r\n\x1a\n"


def test_nine_step_rate_fits_the_overlap_of_a_link_bound_point() -> None:
    # 1 Gbit over 1 Gbit/s takes 1 s; a wait of 0.2 s there means 0.8 s overlapped prefill.
    rate, how = bench.nine_step_rate([(1.0, 0.2), (10.0, 0.0)], 0.5, 125_000_000, 3.0)
    assert "fitted" in how and rate == pytest.approx(1 / (0.8 + 0.5))
    rate, how = bench.nine_step_rate([(1.0, 0.0), (10.0, 0.0)], 0.5, 125_000_000, 3.0)
    assert "prefill" in how and rate == pytest.approx(1 / (3.0 + 0.5))


def test_bad_settings_are_refused(tiny_llama_dir: str, capsys) -> None:
    assert bench.main(["--model", tiny_llama_dir, "--link-gbps", "0", "--no-progress"]) == 2
    assert "--link-gbps" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
                    reason="a shaped link needs root, ip and tc")
def test_one_shaped_point(tiny_llama_dir: str, capsys) -> None:
    doc = _run(capsys, "--model", tiny_llama_dir, "--link", "shaped", "--prompt-tokens", "48",
               "--link-gbps", "0.01", "--chunk-tokens", "64", "--no-nine-step-point")
    assert doc["link"]["shaped"] is True
    _check_rows(doc, {(48, 0.01)})
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"pdxa{os.getpid() % 100000}" not in left  # namespaces removed on exit
