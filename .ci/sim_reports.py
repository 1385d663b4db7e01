"""Write the simulator's reports for a few configurations to DIR (one JSON each), for
.ci/compiled to compare the compiled modules' reports with the interpreted ones' byte for byte.
`--compiled yes|no` first checks that every module of `pdserve.compiled.MODULES` runs compiled
(or none does)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from pdserve.bench.route_trace import default_trace_path
from pdserve.compiled import MODULES, compiled
from pdserve.sim.config import SimConfig
from pdserve.core.step_profile import load_profile
from pdserve.sim.run import simulate
from pdserve.sim.trace import for_cluster, load_trace


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--compiled", choices=("yes", "no"), required=True)
    args = p.parse_args()
    have = compiled()
    want = list(MODULES) if args.compiled == "yes" else []
    if have != want:
        print(f"compiled modules: {have}, expected {want}", file=sys.stderr)
        return 1
    profile = load_profile("h100-llama3-8b")
    mooncake = load_trace(str(default_trace_path()), seed=0)
    cases = {
        "synthetic_kv_aware": (SimConfig(prefill_workers=4, decode_workers=4, seed=0),
                               load_trace("synthetic:poisson:rate=40,n=3000,in=512,out=128",
                                          seed=0)),
        "mooncake_controller": (SimConfig(prefill_workers=8, decode_workers=8, controller=True,
                                          kv_blocks=3000, seed=0), mooncake[:2000]),
        "mooncake_1000_workers": (SimConfig(prefill_workers=750, decode_workers=250,
                                            block_size=512, seed=0),
                                  for_cluster(mooncake, workers=1000, workers_per_copy=8,
                                              duration_s=8.0)),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, (cfg, requests) in cases.items():
        started = time.perf_counter()
        report = simulate(cfg, requests, profile)
        (out / f"{name}.json").write_text(report.to_json())
        print(f"{name}: {len(requests)} requests, {report.summary()['finished']} finished, "
              f"{time.perf_counter() - started:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
