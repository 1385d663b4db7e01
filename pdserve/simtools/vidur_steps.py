"""One step's time as vidur's predictor and as our profiles give it, for the same batches: where
the simulated latencies of `vidur_compare` part comes from.

Owns the representative batches (decode batches, prefills alone and on a context, prefills
mixed with decodes), asking vidur's own execution-time predictor for each (a short script run
in vidur's virtual environment on the configuration and predictor cache of a finished vidur run,
so it trains nothing) and our `StepProfile.step_s` for the same work. vidur's batch convention
is its scheduler's: a sequence's KV count includes the tokens of this step.
Must not download anything or copy vidur's code: vidur computes its own numbers.
"""

from __future__ import annotations

import json
import os
import subprocess

from pdserve.core.step_profile import StepProfile, attn_pairs

# (name, prefill chunks as (tokens, context before the chunk), decode contexts)
STEP_CASES: tuple[tuple[str, tuple[tuple[int, int], ...], tuple[int, ...]], ...] = (
    ("decode 1 x 1,024 ctx", (), (1024,)),
    ("decode 32 x 1,024 ctx", (), (1024,) * 32),
    ("decode 96 x 1,024 ctx", (), (1024,) * 96),
    ("prefill 1,024", ((1024, 0),), ()),
    ("prefill 512 on 2,048 ctx", ((512, 2048),), ()),
    ("prefill 4,000", ((4000, 0),), ()),
    ("prefill 1,024 + decode 32 x 1,024", ((1024, 0),), (1024,) * 32),
    ("prefill 3,000 + decode 96 x 1,024", ((3000, 0),), (1024,) * 96),
)

_SCRIPT = """
import json, sys
from vidur.config import SimulationConfig
from vidur.entities import Batch, Request
from vidur.execution_time_predictor import ExecutionTimePredictorRegistry
from vidur.types.replica_id import ReplicaId
cases = json.loads(sys.stdin.read())
cfg = SimulationConfig.create_from_cli_args()
pred = ExecutionTimePredictorRegistry.get(
    cfg.execution_time_predictor_config.get_type(),
    predictor_config=cfg.execution_time_predictor_config,
    replica_config=cfg.cluster_config.replica_config,
    cache_config=cfg.cluster_config.cache_config)
out = []
for prefills, decodes in cases:
    q = [c for c, _ in prefills] + [1] * len(decodes)
    kv = [k + c for c, k in prefills] + [d + 1 for d in decodes]
    reqs = [Request(0.0, max(n, 1), 1) for n in q]
    out.append(pred.get_execution_time(Batch(ReplicaId(0), reqs, q, kv), 0).total_time)
print("STEP_TIMES " + json.dumps(out))
"""


def vidur_step_times(venv: str, run: dict, workdir: str, cases=STEP_CASES) -> list[float]:
    """Seconds per case from vidur's predictor, with the command line of `run` (a finished
    `vidur_compare.run_vidur` result, whose predictor cache holds the trained models)."""
    py = os.path.join(venv, "bin", "python")
    args = list(run["command"][2:])  # drop "-m vidur.main"
    i = args.index("--metrics_config_output_dir")
    args[i + 1] = os.path.join(workdir, "step-metrics")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    env.pop("PYTHONPATH", None)
    payload = json.dumps([[list(map(list, p)), list(d)] for _, p, d in cases])
    out = subprocess.run([py, "-c", _SCRIPT, *args], input=payload, capture_output=True,
                         text=True, timeout=900, env=env, cwd=workdir)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("STEP_TIMES ")), None)
    if out.returncode != 0 or line is None:
        tail = "\n".join((out.stdout + out.stderr).strip().splitlines()[-8:])
        raise RuntimeError(f"vidur's predictor exited with {out.returncode}:\n{tail}")
    return [float(x) for x in json.loads(line[len("STEP_TIMES "):])]


def profile_step_s(profile: StepProfile, prefills, decodes) -> float:
    """Our profile's time for one step of this work (what the simulated worker charges)."""
    return profile.step_s(
        prefill_tokens=sum(c for c, _ in prefills),
        attn_pairs=sum(attn_pairs(c, k) for c, k in prefills),
        decode_batch=len(decodes), decode_ctx=sum(decodes),
        kv_read_tokens=sum(decodes) + sum(c + k for c, k in prefills))


def step_table(venv: str, vidur_runs: dict[str, dict], profiles: dict[str, StepProfile],
               workdir: str, cases=STEP_CASES) -> list[dict]:
    """Per case: seconds from each vidur run's predictor and from each of our profiles."""
    cols = {name: vidur_step_times(venv, run, workdir, cases)
            for name, run in vidur_runs.items()}
    for name, prof in profiles.items():
        cols[name] = [profile_step_s(prof, p, d) for _, p, d in cases]
    return [{"case": c[0], **{name: v[i] for name, v in cols.items()}}
            for i, c in enumerate(cases)]
