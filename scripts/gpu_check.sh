#!/usr/bin/env bash
# The device check on a GPU host, in at most about 10 minutes on one H100/H200-class GPU.
# Installs pdserve over the host's own torch and Triton (never replaced: `pip install --no-deps
# -e .`, and the pure-Python requirements the host lacks installed with torch and triton pinned
# to the versions already there), then runs `python -m pdserve.bench.gpu_check`: parity with
# transformers on the GPU, the Triton kernels against their references, `bench decode` against
# transformers and the HBM-bandwidth bound at batch 1/8/32/128, and the embedded cluster serving
# a request. It writes gpu_check.json and gpu_check.log into $OUT (or --out DIR, else
# ./gpu_check_out) and prints a table. A failed step is recorded; the next one still runs.
#
# Usage: scripts/gpu_check.sh [gpu_check flags]   e.g. --device cuda:1 --model /models/llama-3-8b
# Environment: PYTHON (default python3, the one holding the host's torch); WHEELS=DIR installs
# the missing requirements from wheels in DIR, offline (made elsewhere with `pip download`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { printf '==> %s\n' "$*" >&2; }

if ! "$PY" -c 'import torch' 2>/dev/null; then
  echo "gpu_check: $PY has no torch; run it with the Python that holds the host's CUDA torch (PYTHON=...)" >&2
  exit 2
fi
before=$("$PY" -c 'import torch; print(torch.__version__)')
say "torch $before ($("$PY" -c 'import torch; print("CUDA", torch.version.cuda, "available:", torch.cuda.is_available())'))"

missing=$(PYTHONPATH="$PWD" "$PY" -m pdserve.bench.gpu_check --missing-deps pyproject.toml)
if [ -n "$missing" ]; then
  say "installing what this host lacks: $(echo "$missing" | tr '\n' ' ')"
  constraints=$(mktemp)
  "$PY" - >"$constraints" <<'PY'
from importlib.metadata import PackageNotFoundError, version
for name in ("torch", "triton"):
    try:
        print(f"{name}=={version(name)}")
    except PackageNotFoundError:
        pass
PY
  source_args=()
  [ -n "${WHEELS:-}" ] && source_args=(--no-index --find-links "$WHEELS")
  mapfile -t reqs <<<"$missing"
  "$PY" -m pip install -q "${source_args[@]}" -c "$constraints" "${reqs[@]}"
  rm -f "$constraints"
fi
say "installing pdserve (editable, no dependencies)"
"$PY" -m pip install -q --no-deps --no-build-isolation -e .
after=$("$PY" -c 'import torch; print(torch.__version__)')
if [ "$before" != "$after" ]; then
  echo "gpu_check: torch changed from $before to $after during the install; stopping" >&2
  exit 2
fi
say "running the check"
exec timeout 700 "$PY" -m pdserve.bench.gpu_check "$@"
