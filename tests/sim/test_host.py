"""Workers sharing a host's CPU cores: the contention factor, steps that stretch while others
compute (and shrink back when they stop), and GPU profiles that stay as they were."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from pdserve.sim.config import SimConfig, SimConfigError
from pdserve.sim.host import contention
from pdserve.core.step_profile import ProfileError, StepProfile, load_profile
from pdserve.sim.run import simulate
from pdserve.sim.trace import SimRequest, load_trace

MOONCAKE = str(Path(__file__).parent / "data" / "mooncake_head60.jsonl")
# A CPU-like profile on one shared core: a prefill of n tokens takes 0.1 + 0.01 n seconds.
ONE_CORE = StepProfile(origin="test: one shared core", model="m", overhead_s=0.1,
                       prefill_token_s=0.01, decode_seq_s=0.01, kv_bytes_per_token=1,
                       kv_capacity_tokens=1 << 20, host_cores=1, threads_per_worker=1,
                       transports={"tcp": load_profile("h100-llama3-8b").transports["tcp"]})
SOLO = 0.1 + 0.01 * 100  # one 100-token prefill, alone


def test_contention_factor():
    assert contention(1, 1, 2) == 1.0
    assert contention(2, 1, 2) == 1.0
    assert contention(3, 1, 2) == 1.5
    assert contention(4, 1, 2) == 2.0
    assert contention(2, 2, 2) == 2.0  # two workers of two threads each on two cores
    assert contention(2, 1, 1) == 2.0
    # A measured table wins over the core count; past its end, its last share per worker.
    assert contention(2, 1, 2, (1.0, 1.6)) == 1.6
    assert contention(4, 1, 2, (1.0, 1.6)) == pytest.approx(3.2)
    assert contention(1, 1, 2, (0.9,)) == 1.0  # never faster than alone
    # Other work on the host takes its fair share of the cores, table or not.
    assert contention(2, 1, 2, background=1.0) == 1.5
    assert contention(1, 1, 2, background=0.5) == 1.0
    assert contention(2, 1, 2, (1.0, 1.2), background=2.0) == 2.0
    assert contention(2, 1, 2, (1.0, 1.2), background=0.2) == 1.2
    with pytest.raises(ValueError, match="busy_workers"):
        contention(0, 1, 2)
    with pytest.raises(ValueError, match="background"):
        contention(1, 1, 2, background=-1.0)


def prefills(arrivals: list[float], prefill_workers: int, workers_per_host):
    """100-token prompts with one output token (the request ends at its prefill)."""
    reqs = [SimRequest(f"r{i}", t, 100, 1, (i,)) for i, t in enumerate(arrivals)]
    cfg = SimConfig(prefill_workers=prefill_workers, decode_workers=1,
                    workers_per_host=workers_per_host, stats_interval_s=100.0)
    rep = simulate(cfg, reqs, ONE_CORE)
    assert rep.status == ["ok"] * len(reqs)
    return rep


def test_two_busy_one_thread_workers_on_one_core_take_twice_as_long():
    alone = prefills([0.0, 0.0], 2, None)
    shared = prefills([0.0, 0.0], 2, 3)
    assert alone.prefill_worker[0] != alone.prefill_worker[1]  # they do compute at once
    assert alone.ttft_s == pytest.approx([SOLO, SOLO])
    assert shared.ttft_s == pytest.approx([2 * SOLO, 2 * SOLO])
    # Each worker on its own host: as if alone.
    assert prefills([0.0, 0.0], 2, 1).ttft_s == pytest.approx([SOLO, SOLO])


def test_other_work_on_the_host_slows_every_step():
    reqs = [SimRequest("r0", 0.0, 100, 1, (0,))]
    cfg = SimConfig(prefill_workers=1, decode_workers=1, workers_per_host=2,
                    host_background_threads=1.0, stats_interval_s=100.0)
    assert simulate(cfg, reqs, ONE_CORE).ttft_s == pytest.approx([2 * SOLO])


def test_a_step_in_progress_slows_when_another_starts_and_speeds_up_when_it_ends():
    rep = prefills([0.0, SOLO / 2], 2, 3)
    # r0: half its work alone, the other half at half speed; r1: half at half speed (until r0
    # ends at 1.5 x SOLO), the rest alone.
    assert rep.ttft_s[0] == pytest.approx(1.5 * SOLO)
    assert rep.ttft_s[1] == pytest.approx(1.5 * SOLO)


def test_a_gpu_profile_is_unaffected_by_workers_per_host():
    reqs = load_trace(MOONCAKE)
    base = SimConfig(prefill_workers=2, decode_workers=2)
    h100 = load_profile("h100-llama3-8b")
    assert h100.host_cores is None
    a = simulate(base, reqs, h100).to_json()
    b = simulate(dataclasses.replace(base, workers_per_host=4), reqs, h100).to_json()
    ja, jb = json.loads(a), json.loads(b)
    assert jb["config"].pop("workers_per_host") == 4
    ja["config"].pop("workers_per_host")
    assert ja == jb


def test_a_cpu_profile_without_workers_per_host_is_per_worker():
    reqs = [SimRequest(f"r{i}", 0.05 * i, 200, 8, (i,)) for i in range(8)]
    cpu = load_profile("cpu-smollm2-135m")
    assert cpu.host_cores is not None
    cfg = SimConfig(prefill_workers=2, decode_workers=2)
    own = dataclasses.replace(cpu, host_cores=None)
    alone = simulate(cfg, reqs, cpu)
    assert alone.to_json() == simulate(cfg, reqs, own).to_json()
    # Four one-thread workers on the calibration's two cores: slower on the whole.
    shared = simulate(dataclasses.replace(cfg, workers_per_host=4), reqs, cpu)
    assert shared.status == alone.status == ["ok"] * len(reqs)
    assert sum(shared.end_s) > sum(alone.end_s)


def test_host_fields_round_trip_and_bad_values_name_the_field():
    p = dataclasses.replace(ONE_CORE, host_slowdown=(1.0, 1.5), host_slowdown_decode=(1.0, 1.2))
    assert StepProfile.from_json(p.to_json()) == p
    with pytest.raises(ProfileError, match="host_cores"):
        dataclasses.replace(ONE_CORE, host_cores=0)
    with pytest.raises(ProfileError, match="threads_per_worker"):
        dataclasses.replace(ONE_CORE, threads_per_worker=0)
    with pytest.raises(ProfileError, match="host_slowdown"):
        dataclasses.replace(ONE_CORE, host_slowdown=(1.0, -2.0))
    with pytest.raises(ProfileError, match="host_slowdown_decode"):
        dataclasses.replace(ONE_CORE, host_slowdown_decode=(1.0, float("nan")))
    with pytest.raises(SimConfigError, match="workers_per_host"):
        SimConfig(workers_per_host=0)
    with pytest.raises(SimConfigError, match="host_background_threads"):
        SimConfig(host_background_threads=-1.0)


def test_a_decode_step_beside_computing_prefills_takes_its_own_table():
    from types import SimpleNamespace

    from pdserve.sim.host import HostShare

    p = dataclasses.replace(ONE_CORE, host_cores=2, host_slowdown=(1.0, 1.1),
                            host_slowdown_decode=(1.0, 1.6))
    share = HostShare(p, 2, ["a", "b"])
    share.busy[0] = {"b"}
    assert share.factor(0, "a") == (1.1, 1.6)
    st = share.profile_for(SimpleNamespace(address="a"))
    assert st.decode_s(4, 400) == pytest.approx(p.decode_s(4, 400) * 1.6)
    assert st.prefill_s(100) == pytest.approx(p.prefill_s(100) * 1.1)
    assert st.step_s(prefill_tokens=100) == pytest.approx(p.step_s(prefill_tokens=100) * 1.1)
    # Alone on the host: neither stretches. Without a decode table: both take the one table.
    share.busy[0] = set()
    assert share.factor(0, "a") == (1.0, 1.0)
    assert share.profile_for(SimpleNamespace(address="a")) is p
    plain = HostShare(dataclasses.replace(p, host_slowdown_decode=()), 2, ["a", "b"])
    plain.busy[0] = {"b"}
    assert plain.factor(0, "a") == (1.1, 1.1)


def test_decodes_beside_a_long_prefill_slow_by_the_decode_table_and_the_prefill_does_not():
    # r0 decodes 20 tokens while r1's 1,000-token prefill computes on the other core.
    reqs = [SimRequest("r0", 0.0, 100, 20, (0,)), SimRequest("r1", SOLO + 0.05, 1000, 1, (1,))]
    cfg = SimConfig(prefill_workers=1, decode_workers=1, workers_per_host=2,
                    stats_interval_s=100.0)
    base = dataclasses.replace(ONE_CORE, host_cores=2, host_slowdown=(1.0, 1.0))
    even = simulate(cfg, reqs, base)
    hurt = simulate(cfg, reqs, dataclasses.replace(base, host_slowdown_decode=(1.0, 2.0)))
    assert even.status == hurt.status == ["ok", "ok"]
    assert hurt.ttft_s == pytest.approx(even.ttft_s)  # the prefills are as they were
    d_even = even.end_s[0] - even.ttft_s[0]
    d_hurt = hurt.end_s[0] - hurt.ttft_s[0]
    assert d_hurt == pytest.approx(2 * d_even, rel=0.1)  # the decode ran beside it throughout
