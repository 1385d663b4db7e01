"""Planning: the phase-shifting trace shifts its work half way, the candidate set covers the
splits, policies and controller settings, bad flags are named, and a small plan runs end to end
through the simulator and writes its table, JSON and plot; jobs are chosen from the memory a
candidate is estimated to take, each job's peak memory is reported, a plan that cannot fit or
a job that dies ends in one line, and progress says the time left."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.sim.plan import (Candidate, PlanError, add_arguments, best_of, controller_candidates,
                              phase_shift_trace, routing_candidates, settings_from_args, split,
                              static_candidates)

ROOT = Path(__file__).resolve().parents[2]


def _parse(*argv: str):
    import argparse
    return add_arguments(argparse.ArgumentParser()).parse_args(list(argv))


def test_phase_trace_shifts_from_prefill_to_decode_work():
    reqs = phase_shift_trace(duration_s=600, rate=4.0, seed=1)
    assert reqs == phase_shift_trace(duration_s=600, rate=4.0, seed=1)  # seeded
    assert all(0 <= r.arrival_s < 600 for r in reqs)
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    first = [r for r in reqs if r.arrival_s < 300]
    second = [r for r in reqs if r.arrival_s >= 300]
    ratio = [sum(r.prompt_tokens for r in h) / sum(r.output_tokens for r in h)
             for h in (first, second)]
    assert ratio[0] > 50 * ratio[1]  # prompt tokens per output token collapses half way
    assert 0.8 < len(reqs) / (600 * 4.0) < 1.2
    ids = [h for r in reqs for h in r.block_hashes]
    assert len(ids) == len(set(ids))  # no shared prefixes: the shift is the only change


def test_candidates():
    assert split(1000, 0.25) == (250, 750)
    assert split(4, 0.05) == (1, 3) and split(4, 0.99) == (3, 1)
    static = static_candidates(1000)
    assert [c.prefill_workers for c in static] == [125, 250, 375, 500, 625, 750]
    assert all(c.prefill_workers + c.decode_workers == 1000 for c in static)
    assert len(static_candidates(4)) == 3  # duplicates of tiny clusters collapse
    ctl = controller_candidates(1000)
    assert all(c.controller for c in ctl)
    assert {"fluid_token": False} in [c.policy for c in ctl]
    assert any(c.policy.get("max_flips_per_tick") == 10 for c in ctl)
    pols = {c.prefill_policy for c in routing_candidates(static[1])}
    assert "kv_aware" not in pols and {"round_robin", "least_loaded"} <= pols


def test_best_of_prefers_goodput_then_attainment_then_fewer_worker_hours():
    rows = [{"name": "a", "goodput_rps": 5, "attainment": 0.9, "worker_hours": 10},
            {"name": "b", "goodput_rps": 5, "attainment": 0.9, "worker_hours": 8},
            {"name": "c", "goodput_rps": 4, "attainment": 1.0, "worker_hours": 1}]
    assert best_of(rows)["name"] == "b"


@pytest.mark.parametrize("argv,field", [(("--workers", "1"), "--workers"),
                                        (("--itl-slo-ms", "0"), "--itl-slo-ms"),
                                        (("--transport", "rdma"), "--transport"),
                                        (("--jobs", "0"), "--jobs"),
                                        (("--block-size", "0"), "--block-size")])
def test_bad_flags_are_named(argv, field):
    with pytest.raises(PlanError, match=field):
        settings_from_args(_parse("--trace", "phase", *argv))


def test_defaults_are_stated():
    s = settings_from_args(_parse("--trace", "phase"))
    assert (s["workers"], s["ttft_slo_ms"], s["itl_slo_ms"]) == (1000, 2000.0, 100.0)
    assert s["profile"] == "h100-llama3-8b"
    assert s["block_size"] == 16
    from pdserve.sim.plan import _sim_config
    s512 = settings_from_args(_parse("--trace", "phase", "--block-size", "512"))
    assert _sim_config(Candidate("x", "static", 1, 1), s512).block_size == 512
    assert Candidate("x", "static", 1, 1).prefill_policy == "kv_aware"


def test_small_plan_end_to_end(tmp_path):
    out = tmp_path / "plan"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.sim.plan", "--trace", "phase", "--workers", "4",
         "--duration-s", "60", "--rate", "0.5", "--jobs", "1", "--out", str(out), "--json"],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[plan" in proc.stderr
    doc = json.loads(proc.stdout)
    kinds = {r["kind"] for r in doc["rows"]}
    assert kinds == {"static", "routing", "controller"}
    assert doc["best"] in {r["name"] for r in doc["rows"]}
    for r in doc["rows"]:
        assert 0.0 <= r["attainment"] <= 1.0
        assert r["worker_hours"] > 0
        assert r["finished"] + r["rejected"] <= r["requests"]
    assert all(r["roles"] for r in doc["rows"] if r["controller"])
    assert all(r["peak_rss_bytes"] > 10_000_000 for r in doc["rows"])
    assert doc["jobs"]["jobs"] == 1 and doc["jobs"]["per_job_estimate_bytes"] > 0
    assert "jobs: 1 at once (--jobs" in proc.stderr
    assert "static 1P:3D: started" in proc.stderr
    assert (out / "plan.png").stat().st_size > 10_000
    assert json.loads((out / "plan.json").read_text())["rows"] == doc["rows"]


# ---- jobs, memory, progress and failures -------------------------------------------------------

def test_jobs_are_as_many_as_memory_holds_at_most_one_per_core_and_candidate():
    from pdserve.sim.plan_jobs import choose_jobs

    GB = 10**9
    assert choose_jobs(21 * GB, 7 * GB, cpus=2, candidates=6) == 2
    assert choose_jobs(21 * GB, 7 * GB, cpus=16, candidates=6) == 2  # 90% of 21 holds 2
    assert choose_jobs(64 * GB, 1 * GB, cpus=16, candidates=6) == 6
    assert choose_jobs(10 * GB, 7 * GB, cpus=2, candidates=6) == 1
    assert choose_jobs(6 * GB, 7 * GB, cpus=2, candidates=6) == 0  # not even one fits
    assert choose_jobs(None, 7 * GB, cpus=3, candidates=6) == 3  # memory unknown: the cores


def test_available_memory_is_read_from_meminfo(tmp_path):
    from pdserve.sim.plan_jobs import available_memory_bytes

    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   21000000 kB\n")
    assert available_memory_bytes(str(f)) == 21_000_000 * 1024
    f.write_text("MemTotal:       24000000 kB\n")
    assert available_memory_bytes(str(f)) is None
    assert available_memory_bytes(str(tmp_path / "missing")) is None


def test_the_memory_estimate_grows_with_pools_store_and_requests_and_saturates():
    from pdserve.sim.plan_jobs import JobSize, job_memory_bytes

    hour = JobSize(workers=1000, blocks_per_worker=25_127, store_blocks=10_000_000,
                   requests=1_524_625, prompt_blocks=750.0)
    est = job_memory_bytes(hour)
    assert 8e9 < est < 16e9  # the hour, 16-token blocks (measured: 9.5 GB after 2 minutes)
    coarse = job_memory_bytes(JobSize(1000, 785, 10_000_000, 1_524_625, 23.0))
    assert coarse < est / 2  # 512-token blocks: a 32nd of the pools
    # Past the pools' and the store's size, more requests cost only their own records.
    longer = job_memory_bytes(JobSize(1000, 25_127, 10_000_000, 2 * 1_524_625, 750.0))
    assert 0 < longer - est < 1_524_625 * 2_000
    tiny = job_memory_bytes(JobSize(4, 100, 10_000_000, 100, 2.0))
    assert tiny < 0.5e9


def test_a_plan_that_cannot_fit_says_so_in_one_line():
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.sim.plan", "--trace", "phase", "--workers", "4",
         "--duration-s", "20", "--max-memory-gb", "0.01", "--json"],
        capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stdout == ""
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "GB" in errors[0] and "--block-size" in errors[0]
    assert "Traceback" not in proc.stderr


class _KilledOnArrival:
    """A candidate whose job process dies (SIGKILL, as the out-of-memory killer sends) as it
    unpickles it."""
    name = "static 9P:9D"

    def __reduce__(self):
        import signal
        return (signal.raise_signal, (signal.SIGKILL,))


def _settings(**kw):
    s = settings_from_args(_parse("--trace", "phase", "--workers", "2", "--duration-s", "20",
                                  "--rate", "0.5"))
    s.update(kw)
    return s


def test_a_job_process_that_dies_is_named_and_the_others_are_stopped():
    import io

    from rich.console import Console

    from pdserve.sim.plan import load_requests
    from pdserve.sim.plan_jobs import JobFailed, run_jobs
    from pdserve.sim.plan_progress import PlanProgress

    s = _settings()
    reqs = load_requests("phase", workers=2, workers_per_copy=8, duration_s=20, rate=0.5,
                         seed=0)
    lines: list[str] = []
    cands = [Candidate("static 1P:1D", "static", 1, 1), _KilledOnArrival()]
    with PlanProgress(Console(file=io.StringIO()), 20.0, lines.append, live=False) as bar:
        with pytest.raises(JobFailed, match=r"'static 9P:9D'.*SIGKILL.*out-of-memory.*try"):
            run_jobs(cands, reqs, s, 2, bar, hint="try --jobs 1")
    rows = run_jobs(cands[:1], reqs, s, 1, PlanProgress(Console(file=io.StringIO()), 20.0,
                                                        lines.append, live=False))
    assert rows[0]["peak_rss_bytes"] > 10_000_000  # each job's own peak resident memory
    assert any("attainment" in line and "peak" in line for line in lines)


def test_progress_says_simulated_time_wall_time_and_time_left():
    import io

    from rich.console import Console

    from pdserve.sim.plan_progress import PlanProgress, duration, progress_text, time_left_s

    assert time_left_s(0.0, 100.0, 5.0) is None
    assert time_left_s(25.0, 100.0, 10.0) == pytest.approx(30.0)
    assert time_left_s(150.0, 100.0, 10.0) == 0.0  # past the span: the tail drains
    assert (duration(45), duration(720), duration(3 * 3600 + 360)) == ("45 s", "12 min", "3.1 h")
    assert (progress_text(900.0, 3600.0, 600.0)
            == "simulated 900/3600 s, 10 min wall, about 30 min left")

    now = [0.0]
    lines: list[str] = []
    with PlanProgress(Console(file=io.StringIO()), 3600.0, lines.append, live=False,
                      every_s=30.0, clock=lambda: now[0]) as bar:
        bar.start(0, "static 1P:1D")
        for t in range(1, 100):
            now[0] = float(t)
            bar.tick(0, 10.0 * t)
        assert bar.end(0) == 99.0
    assert lines[0] == "static 1P:1D: started"
    assert lines[1:] == [f"static 1P:1D: {progress_text(10.0 * t, 3600.0, t)}"
                         for t in (30, 60, 90)]

    out = io.StringIO()
    with PlanProgress(Console(file=out, force_terminal=True, width=150), 3600.0, lines.append,
                      live=True, clock=lambda: now[0]) as bar:
        bar.start(1, "controller (defaults)")
        now[0] += 60.0
        bar.tick(1, 1800.0)
        bar._bar.refresh()
    shown = out.getvalue()
    assert "controller (defaults)" in shown and "simulated 1800/3600 s" in shown
    assert "about 60 s left" in shown
