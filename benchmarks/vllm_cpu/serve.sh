#!/usr/bin/env bash
# Start vLLM's (CPU backend) OpenAI-compatible server on the default kvserve model, for
# `kvserve bench serve --base-url http://127.0.0.1:8001`.
#
#   bash benchmarks/vllm_cpu/serve.sh [--dtype float32|bfloat16] [--port 8001] [extra vLLM args...]
#   MODEL_DIR=/path/to/hf/dir bash benchmarks/vllm_cpu/serve.sh
#
# The model is served under the name "default" (pass --model default to the load generator,
# or --served-model-name X here). `vllm serve` fails to find its own distribution name in the
# vllm-cpu package, so the module entry point is used instead.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
source "$HERE/env.sh"

DTYPE=float32
PORT=8001
EXTRA=()
while [ $# -gt 0 ]; do
    case "$1" in
        --dtype) DTYPE="$2"; shift 2;;
        --port) PORT="$2"; shift 2;;
        *) EXTRA+=("$1"); shift;;
    esac
done
if [ -z "${MODEL_DIR:-}" ]; then
    MODEL_DIR="$("${KVSERVE_PYTHON:-$REPO/.venv/bin/python}" -c \
        'from kvserve.model_executor.model_loader import resolve_model_dir; print(resolve_model_dir(None))')"
fi
echo "[vllm serve] model $MODEL_DIR dtype $DTYPE port $PORT" >&2
echo "[vllm serve] OMP bind $VLLM_CPU_OMP_THREADS_BIND, KV cache ${VLLM_CPU_KVCACHE_SPACE} GiB, LD_PRELOAD=$LD_PRELOAD" >&2
exec "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$MODEL_DIR" --served-model-name default --dtype "$DTYPE" \
    --host 127.0.0.1 --port "$PORT" "${EXTRA[@]}"
