#!/usr/bin/env bash
# Every comparison of docs/benchmarks.md, one after another (nothing else should run meanwhile:
# the machine has 2 cores). Results (JSON, PNG, logs) go to $OUT (default benchmarks/results/<date>).
#
#   bash benchmarks/run_all.sh                 # all (~45-60 min on 2 cores, most of it transformers bs=1)
#   STEPS="offline vllm_offline" bash benchmarks/run_all.sh
#   STEPS: offline baseline vllm_offline serve vllm_serve cold_start plots (default: all of them)
#          quantized (opt-in, ~20 min): batch-1 gguf/int8 vs float/bfloat16 vs llama.cpp's llama-server,
#          then w64 per format; needs bash benchmarks/llama_cpp/setup.sh (or NO_PEER=1)
#          spec_decode (opt-in, ~15 min): speculation off vs n-gram vs draft model (the target as its
#          own draft), float32 and bfloat16: input-grounded 1 at a time and 8 at once, then w64
#   NO_BASELINE=1 skips transformers; WORKLOAD=... changes the workload (default shared w64).
# Needs the vLLM venv for the vllm_* steps: bash benchmarks/vllm_cpu/setup.sh
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
PY="${KVSERVE_PYTHON:-$REPO/.venv/bin/python}"
VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"
WORKLOAD="${WORKLOAD:-$REPO/../shared/workloads/w64.jsonl}"
OUT="${OUT:-$REPO/benchmarks/results/$(date +%Y%m%d-%H%M%S)}"
STEPS="${STEPS:-offline baseline vllm_offline serve vllm_serve cold_start plots}"
KV_PORT="${KV_PORT:-8002}"
VLLM_PORT="${VLLM_PORT:-8001}"
mkdir -p "$OUT"
echo "[run_all] results in $OUT"
has() { [[ " $STEPS " == *" $1 "* ]]; }

wait_up() {  # url seconds
    for _ in $(seq 1 "$2"); do curl -sf -m 2 "$1/v1/models" >/dev/null && return 0; sleep 1; done
    echo "[run_all] server $1 did not come up" >&2; return 1
}
stop_pid() {  # pid
    kill -TERM "$1" 2>/dev/null; for _ in $(seq 1 60); do kill -0 "$1" 2>/dev/null || return 0; sleep 1; done
    kill -KILL "$1" 2>/dev/null
}

if has offline; then
    for dt in float32 bfloat16; do
        extra=(--no-baseline)
        if [ "$dt" = float32 ] && has baseline && [ -z "${NO_BASELINE:-}" ]; then extra=(${BASELINE_ARGS:-}); fi
        "$PY" -m kvserve bench throughput --workload "$WORKLOAD" --dtype "$dt" "${extra[@]}" \
            --json-out "$OUT/offline_kvserve_$dt.json" --plot-dir "$OUT/offline_$dt" 2>&1 | tee "$OUT/offline_kvserve_$dt.log"
    done
fi
if has vllm_offline; then
    for dt in float32 bfloat16; do
        "$VLLM_VENV/bin/python" benchmarks/vllm_cpu/offline.py --workload "$WORKLOAD" --dtype "$dt" \
            --json-out "$OUT/offline_vllm_$dt.json" 2>&1 | tee "$OUT/offline_vllm_$dt.log" | grep -v "^(.*INFO\|WARNING"
    done
fi
if has serve; then
    "$PY" -m kvserve serve --port "$KV_PORT" ${KV_SERVE_ARGS:-} > "$OUT/kvserve_server.log" 2>&1 &
    pid=$!
    if wait_up "http://127.0.0.1:$KV_PORT" 300; then
        "$PY" -m kvserve bench serve --base-url "http://127.0.0.1:$KV_PORT" --workload "$WORKLOAD" \
            --request-rate inf --label kvserve --json-out "$OUT/serve_kvserve.json" --plot-dir "$OUT/serve_kvserve" \
            2>&1 | tee "$OUT/serve_kvserve.log"
    fi
    stop_pid "$pid"
fi
if has vllm_serve; then
    bash benchmarks/vllm_cpu/serve.sh --port "$VLLM_PORT" ${VLLM_SERVE_ARGS:-} > "$OUT/vllm_server.log" 2>&1 &
    pid=$!
    if wait_up "http://127.0.0.1:$VLLM_PORT" 900; then
        "$PY" -m kvserve bench serve --base-url "http://127.0.0.1:$VLLM_PORT" --workload "$WORKLOAD" \
            --request-rate inf --label vllm-cpu --json-out "$OUT/serve_vllm.json" --plot-dir "$OUT/serve_vllm" \
            2>&1 | tee "$OUT/serve_vllm.log"
    fi
    stop_pid "$pid"
fi
if has cold_start; then
    "$PY" -m kvserve bench cold-start --json-out "$OUT/cold_start.json" 2>&1 | tee "$OUT/cold_start.log"
fi
if has quantized; then
    peer=(--peer llama.cpp)
    [ -n "${NO_PEER:-}" ] && peer=()
    "$PY" -m kvserve bench quantized --rounds 5 --max-tokens 128 "${peer[@]}" \
        --json-out "$OUT/quantized_batch1.json" 2>&1 | tee "$OUT/quantized_batch1.log"
    "$PY" -m kvserve bench quantized --w64 --workload "$WORKLOAD" "${peer[@]}" \
        --json-out "$OUT/quantized_w64.json" 2>&1 | tee "$OUT/quantized_w64.log"
fi
if has spec_decode; then
    for dt in float32 bfloat16; do
        "$PY" -m kvserve bench spec-decode --dtype "$dt" --methods off,ngram,ngram-fixed,draft-fixed \
            --scenarios single,concurrent --rounds 2 --json-out "$OUT/spec_decode_$dt.json" 2>&1 | tee "$OUT/spec_decode_$dt.log"
        "$PY" -m kvserve bench spec-decode --dtype "$dt" --methods off,ngram --scenarios w64 \
            --w64-workload "$WORKLOAD" --json-out "$OUT/spec_decode_w64_$dt.json" 2>&1 | tee "$OUT/spec_decode_w64_$dt.log"
    done
    "$PY" -m kvserve.benchmarks.plots "$OUT/spec_decode_float32.json" "$OUT/spec_decode_bfloat16.json" \
        --out-dir "$OUT/spec_decode"
fi
if has plots && [ -f "$OUT/serve_kvserve.json" ] && [ -f "$OUT/serve_vllm.json" ]; then
    "$PY" -m kvserve.benchmarks.plots "$OUT/serve_kvserve.json" "$OUT/serve_vllm.json" --out-dir "$OUT/compare"
fi
"$PY" -m kvserve.benchmarks.report "$OUT" | tee "$OUT/summary.md"
