"""`pdserve bench admission`: its figures from requests' endings (pure), its settings' checks,
its files, and (with the long scenarios) a whole run against a real cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.bench.admission import AdmissionBenchSettings, summarize_mode
from pdserve.bench.admission_report import write_outputs
from pdserve.core.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_modes_figures_count_admitted_refused_and_failed_and_set_ttft_against_the_limit():
    codes = ["OK", "RESOURCE_EXHAUSTED", "OK", "UNAVAILABLE", "OK", "OK"]
    ttfts = [1.0, None, 3.0, None, 5.0, 2.0]
    m = summarize_mode("calibrated", codes, ttfts, [100, 200, 300, 400, 500, 600], 10.0, 4.0,
                       8, {"predicted_ttft_factor": 2.5, "prefill_peak_tokens_per_s": 900.0})
    assert (m["sent"], m["admitted"], m["refused"], m["failed"]) == (6, 4, 1, 1)
    assert m["ttfts_s"] == [1.0, 2.0, 3.0, 5.0] and m["ttft_max_s"] == 5.0
    assert m["ttft_p99_s"] == 5.0 and m["p99_over_limit"] == pytest.approx(1.25)
    assert m["within_limit"] == pytest.approx(0.75)
    assert m["admitted_prompt_tokens_per_s"] == pytest.approx((100 + 300 + 500 + 600) / 10.0)
    assert m["ttft_by_arrival"] == [[0, 1.0], [2, 3.0], [4, 5.0], [5, 2.0]]
    assert m["router_factor"] == 2.5
    none = summarize_mode("raw", ["RESOURCE_EXHAUSTED"], [None], [10], 1.0, 4.0, 1, {})
    assert none["admitted"] == 0 and none["ttft_p99_s"] is None and none["within_limit"] is None


def test_settings_name_the_bad_field():
    for bad, field in (({"speedup": 0.0}, "speedup"), ({"limit_s": -1.0}, "limit_s"),
                       ({"modes": ("fast",)}, "modes"), ({"requests": 0}, "requests")):
        with pytest.raises(ConfigError, match=field):
            AdmissionBenchSettings(**bad)


def test_the_files_hold_the_table_and_the_plot(tmp_path):
    modes = {name: summarize_mode(name, ["OK"] * 3 + ["RESOURCE_EXHAUSTED"], [1.0, 2.0, 6.0, None],
                                  [50] * 4, 5.0, 4.0, 4, {"predicted_ttft_factor": f})
             for name, f in (("raw", 1.0), ("calibrated", 2.0))}
    result = {"bench": "admission", "settings": {**AdmissionBenchSettings().__dict__,
                                                 "modes": list(modes)},
              "trace": "t.jsonl", "model": "m.gguf", "modes": modes,
              "machine": {"cpus": 2, "platform": "x"}, "wall_s": 1.0}
    paths = write_outputs(result, str(tmp_path))
    assert [os.path.basename(p) for p in paths] == ["admission.json", "admission.png",
                                                   "admission.md"]
    assert open(paths[1], "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    md = open(paths[2]).read()
    assert "| calibrated | 4 | 3 | 1 | 0 | 2.00 | 6.00 | 6.00 | 1.50 | 66.7% | 30 | 2.00 |" in md
    assert json.load(open(paths[0]))["modes"]["raw"]["admitted"] == 3


@pytest.mark.scenario  # a whole bench run: with the long scenarios (.ci/scenarios)
@pytest.mark.timeout(900)
def test_bench_admission_quick_run_admits_refuses_and_reports_both_modes(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "admission", "--quick", "--json",
         "--no-progress", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=840, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout)
    for name in ("raw", "calibrated"):
        m = result["modes"][name]
        # Past capacity: some requests are admitted and answered, some refused at the door,
        # none fails otherwise.
        assert m["admitted"] > 0 and m["refused"] > 0 and m["failed"] == 0, m
        assert m["sent"] == result["settings"]["requests"]
    assert result["modes"]["raw"]["router_factor"] == 1.0  # the raw model: no correction
    assert os.path.exists(tmp_path / "admission.png")
