"""`pdserve bench sim` end to end on small cases: the document's fields and arithmetic, the
pace along the run (its quarters, the files), and bad flags refused by name."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest

from pdserve.bench.sim import quarters, wall_at
from pdserve.bench.sim_report import aim_pace, pace_segments
from pdserve.cli import main

TRACE = str(Path(__file__).resolve().parent.parent / "data"
            / "mooncake_conversation_trace_head300.jsonl")


def test_the_pace_is_read_between_samples_and_cut_into_quarters():
    pace = [[10.0, 1.0, 5], [20.0, 4.0, 9], [40.0, 5.0, 12]]
    assert wall_at(pace, 0.0) == 0.0
    assert wall_at(pace, 5.0) == pytest.approx(0.5)
    assert wall_at(pace, 30.0) == pytest.approx(4.5)
    assert wall_at(pace, 99.0) == 5.0  # past the last sample: the last
    # Cuts at 0, 10, 20, 30, 40 s: wall 0, 1, 4, 4.5, 5.
    assert quarters(pace, 40.0) == pytest.approx([0.1, 0.3, 0.05, 0.05])
    assert pace_segments(pace) == [(0.0, 10.0, 0.1), (10.0, 20.0, 0.3), (20.0, 40.0, 0.05)]
    assert quarters([], 40.0) == [0.0] * 4


def test_the_aims_pace_per_case():
    hour = {"case": "1000w", "workers": 1000, "requests": 9000, "simulated_s": 60.0}
    assert aim_pace(hour) == pytest.approx(600 / 3600)
    assert aim_pace({**hour, "workers": 200}) is None  # the aim is for 1,000 workers
    full = {"case": "100k", "workers": 16, "requests": 100_000, "simulated_s": 1000.0}
    assert aim_pace(full) == pytest.approx(60 / 1000)
    assert aim_pace({**full, "requests": 20_000, "simulated_s": 200.0}) == pytest.approx(0.06)


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["bench", "sim", *argv])
    return code, out.getvalue(), err.getvalue()


def test_bench_sim_reports_both_cases_with_their_pace_and_a_plot(tmp_path):
    code, out, err = run_cli("--cases", "100k,1000w", "--requests", "1500", "--workers", "40",
                             "--duration-s", "20", "--trace", TRACE, "--json",
                             "--out", str(tmp_path))
    assert code == 0, err
    doc = json.loads(out)
    assert json.loads((tmp_path / "sim_bench.json").read_text()) == doc
    png = (tmp_path / "sim_bench.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
    rows = {r["case"]: r for r in doc["rows"]}
    assert set(rows) == {"100k", "1000w"}
    assert rows["100k"]["requests"] == 1500 and rows["100k"]["workers"] == 16
    w = rows["1000w"]
    assert w["workers"] == 40 and w["copies"] == 5 and w["duration_s"] == 20
    assert w["projected_hour_wall_s"] == pytest.approx(w["wall_s"] * 3600 / 20)
    for r in rows.values():
        assert r["finished"] > 0.9 * r["requests"]
        assert r["events"] > r["requests"]
        assert r["events_per_s"] == pytest.approx(r["events"] / r["wall_s"])
        assert r["requests_per_s"] == pytest.approx(r["requests"] / r["wall_s"])
        pace = r["pace"]
        # Sampled in order, the last at the end of the run with every request resolved.
        assert pace == sorted(pace) and pace[-1][0] == pytest.approx(r["simulated_s"])
        assert pace[-1][2] == r["requests"]
        assert pace[-1][1] == pytest.approx(r["wall_s"], abs=0.05)
        q = r["quarters_wall_per_sim_s"]
        assert len(q) == 4 and all(x > 0 for x in q)
        # The quarters add up to the wall time of the samples.
        assert sum(q) * r["simulated_s"] / 4 == pytest.approx(pace[-1][1], rel=1e-2)


@pytest.mark.parametrize("argv, field", [
    (["--cases", "10k"], "--cases"),
    (["--trace", "/nonexistent/trace.jsonl"], "--trace"),
    (["--duration-s", "0"], "--duration-s"),
])
def test_bad_flags_are_refused_by_name(argv, field):
    code, out, err = run_cli(*argv)
    assert code == 2 and field in err and out == ""


def test_the_tables_say_when_the_simulator_ran_interpreted():
    from pdserve.compiled import MODULES, compiled

    code, out, err = run_cli("--cases", "100k", "--requests", "300")
    assert code == 0, err
    assert "pace: wall seconds per simulated second" in out
    interpreted = len(MODULES) - len(compiled())
    assert ("scripts/compile.sh" in out) == (interpreted > 0)
    if interpreted:
        assert f"{interpreted} of the {len(MODULES)} hot modules ran interpreted" in out

