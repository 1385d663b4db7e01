"""`pdserve bench chaos` on the tiny model, one fault: the command's JSON document, its table
and PNG. The faults themselves are judged in tests/chaos; figures here mean nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import REPO_ROOT


@pytest.mark.timeout(600)
def test_bench_chaos_json_table_and_png(tiny_llama_dir, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "chaos", "--json", "--out", str(tmp_path),
         "--model", tiny_llama_dir, "--faults", "decode", "--requests", "16",
         "--max-tokens", "96"], capture_output=True, text=True, timeout=540, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    [f] = result["faults"]
    assert f["fault"] == "decode" and f["victim"].startswith("decode-")
    assert (f["requests"], f["lost"], f["wrong"], f["completed_correct"]) == (16, 0, 0, 16)
    assert f["restarted"] and f["heal_s"] > 0 and f["serves_after"]
    with open(tmp_path / "chaos.json") as fh:
        assert json.load(fh)["faults"] == result["faults"]
    assert os.path.getsize(tmp_path / "chaos.png") > 5000
    table = (tmp_path / "chaos.md").read_text()
    assert "| decode | decode-" in table and "time to heal s" in table


def test_bench_chaos_refuses_an_unknown_fault():
    out = subprocess.run([sys.executable, "-m", "pdserve.cli", "bench", "chaos", "--faults",
                          "decode,disk"], capture_output=True, text=True, timeout=120,
                         cwd=REPO_ROOT)
    assert out.returncode != 0 and "--faults: unknown disk" in out.stderr
