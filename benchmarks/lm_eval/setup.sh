#!/usr/bin/env bash
# A separate virtual environment with lm-evaluation-harness (PyPI `lm-eval`: its `api` extra for
# the OpenAI-style client, `hf` for its transformers backend, the reference run).
#
#   bash benchmarks/lm_eval/setup.sh            # venv at .lmeval-venv in the repository
#   LMEVAL_VENV=/some/where bash benchmarks/lm_eval/setup.sh
#
# Kept outside kvserve's environment on purpose: lm-eval pulls datasets, evaluate, scikit-learn,
# sacrebleu and more, none of which kvserve or its tests need.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
LMEVAL_VENV="${LMEVAL_VENV:-$REPO/.lmeval-venv}"
PYTHON="${PYTHON:-python3}"
[ -x "$LMEVAL_VENV/bin/python" ] || "$PYTHON" -m venv "$LMEVAL_VENV"
"$LMEVAL_VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
# torch pinned as kvserve's (a CPU build; a looser pin pulls a multi-GB CUDA build)
"$LMEVAL_VENV/bin/python" -m pip install -q "lm-eval[api,hf]==0.4.13" "torch==2.13.0"
echo "[setup] lm-eval in $LMEVAL_VENV"
