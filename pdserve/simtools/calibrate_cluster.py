"""The cluster part of `pdserve sim calibrate`: what a real 1P1D cluster adds to the engine.

Owns the measurements made on a running cluster (each worker on its own share of the cores, as
the profile's threads say): its start-up, the gap between streamed tokens at a few decode batches
and the first token of single prompts of a few lengths (what serving adds to the engine's steps;
`calibrate.fit_serving` and `fit_serving_prefill` fit them) and an idle worker's flip there and
back. Must not fit step constants or simulate.
"""

from __future__ import annotations

import time
from typing import Any


def serving_gaps(cluster, batches: tuple[int, ...], say) -> list[dict[str, float]]:
    """Waves of `batch` requests at once (64-token prompts, 32 tokens out) through the
    cluster's HTTP front door: the median gap between streamed tokens after the second (the
    first gap holds the hand-over), and the decode context then."""
    import random
    from statistics import median

    from pdserve.bench import serve_client as client
    from pdserve.bench.serve import _model_name
    from pdserve.bench.serve_workload import token_request

    rng, prompt, out = random.Random(1), 64, 32
    name = _model_name(cluster.http_address)
    rows = []
    for b in batches:
        reqs = [token_request([rng.randrange(1000, 40000) for _ in range(prompt)], out)
                for _ in range(b)]
        done, _ = client.run_closed(cluster.http_address, name, reqs, b, 300.0)
        gaps = [t1 - t0 for r in done if not r["error"]
                for t0, t1 in zip(r["chunk_times_s"][1:], r["chunk_times_s"][2:])]
        if not gaps:
            raise RuntimeError(f"calibration requests failed: {done[0]['error']}")
        rows.append({"batch": b, "ctx": b * (prompt + out // 2), "gap_s": median(gaps)})
        say(f"served decode batch {b}: {rows[-1]['gap_s'] * 1e3:.1f} ms between tokens")
    return rows


def serving_firsts(cluster, prompts: tuple[int, ...], repeats: int, say) -> list[dict[str, float]]:
    """One request at a time on the idle cluster (fresh prompts of each length in `prompts`,
    `repeats` times, the lengths interleaved; 2 tokens out): the median time to its first token
    at the client, which a served prefill takes beyond the engine's step (`calibrate.
    fit_serving_prefill`)."""
    import random
    from statistics import median

    from pdserve.bench import serve_client as client
    from pdserve.bench.serve import _model_name
    from pdserve.bench.serve_workload import token_request

    rng = random.Random(2)
    name = _model_name(cluster.http_address)
    ttfts: dict[int, list[float]] = {n: [] for n in prompts}
    for _ in range(repeats):
        for n in prompts:
            req = token_request([rng.randrange(1000, 40000) for _ in range(n)], 2)
            done, _ = client.run_closed(cluster.http_address, name, [req], 1, 300.0)
            if done[0]["error"]:
                raise RuntimeError(f"calibration request failed: {done[0]['error']}")
            ttfts[n].append(done[0]["ttft_s"])
    rows = [{"tokens": n, "ttft_s": median(ttfts[n])} for n in prompts]
    for r in rows:
        say(f"served prefill of {r['tokens']} tokens: first token after "
            f"{r['ttft_s'] * 1e3:.1f} ms")
    return rows


def _one_p_one_d(model: str, **spec):
    """A fresh 1P1D cluster, each worker on its own share of the cores (as the profile's
    threads say), to be entered with `with`; `spec`: more ClusterSpec fields (an emulated
    engine's)."""
    from pdserve.launcher.cluster_spec import free_ports
    from pdserve.launcher.local import ClusterSpec, LocalCluster

    return LocalCluster(ClusterSpec(model_path=model, router_port=free_ports(1)[0], http_port=0,
                                    controller=False, ready_timeout_s=600, share_cores=False,
                                    # every prompt through the prefill worker, as simulated
                                    max_local_prefill_tokens=0, **spec))


def _serving(cluster, batches: tuple[int, ...], prompts: tuple[int, ...], say) -> dict[str, Any]:
    return {"serving": serving_gaps(cluster, batches, say),
            "serving_prefill": serving_firsts(cluster, prompts, 3, say)}


def serving_times(model: str, served_batches: tuple[int, ...], served_prompts: tuple[int, ...],
                  say, **spec) -> dict[str, Any]:
    """What serving adds to the engine's steps on a fresh 1P1D cluster (`spec`: more of its
    ClusterSpec): the decode gaps (`serving_gaps`) and the first tokens of single prompts
    (`serving_firsts`)."""
    with _one_p_one_d(model, **spec) as cluster:
        return _serving(cluster, served_batches, served_prompts, say)


def cluster_times(model: str, served_batches: tuple[int, ...], served_prompts: tuple[int, ...],
                  say) -> dict[str, Any]:
    """A fresh 1P1D cluster: its start-up (to every worker serving), what serving adds to the
    engine's steps (`serving_times`' measurements), and one idle worker's flip there and back
    through the controller's Flipper (drain of nothing + switch + verify + re-admit)."""
    from pdserve.controller.flip import Flipper
    from pdserve.controller.routers import Routers

    t0 = time.monotonic()
    with _one_p_one_d(model) as cluster:
        startup = time.monotonic() - t0
        say(f"cluster start-up: {startup:.1f} s")
        serving = _serving(cluster, served_batches, served_prompts, say)
        flipper = Flipper(Routers(cluster.router_control_address).move)
        addr = cluster.worker_addresses("decode")[0]
        flips = [flipper.flip(addr, role, drain_timeout_s=60.0, reason="calibration")
                 for role in ("prefill", "decode")]
        bad = [f.error for f in flips if not f.ok]
        if bad:
            raise RuntimeError(f"a calibration flip failed: {bad[0]}")
        flip = min(f.seconds for f in flips)
        say(f"idle flip: {flip:.2f} s")
    return {"startup_s": startup, "flip_s": flip, **serving}
