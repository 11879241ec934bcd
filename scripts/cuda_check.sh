#!/usr/bin/env bash
# One-shot CUDA check of kvserve on a GPU machine without network (target: < 6 min in all).
#
#   bash scripts/cuda_check.sh          # on the GPU machine, from the repository root
#
# Needs, beside the tracked files, two git-ignored folders carried along:
#   .whl/          wheels of the runtime dependencies that machine lacks (pydantic, fastapi, ...)
#   .cuda_assets/  SmolLM2-135M config + tokenizer files, and the w64 workload (see its README)
# scripts/cuda_check_prepare.sh (run on the CPU machine) creates both folders.
# Steps (each under its own timeout, all under one overall budget; a failed step does not stop
# the next): install the wheels into /tmp/site; print the machine; import smoke test; make a
# random-weight model of SmolLM2-135M's exact shape in /tmp; golden tests on CUDA (engine and
# transformers reference both float32 on the GPU); `kvserve bench throughput` in bfloat16 and
# float32 with the transformers static-batch baseline. Results go to $OUT (5 files):
# cuda_check.log, junit.xml, bench_bf16.json, bench_fp32.json, summary.txt.
#
# KVSERVE_CHECK_STEPS="model bench_bf16" reruns only those steps (names as in main below).
# Local dry run on CPU (small workload, wheels not installed, the venv's python):
#   KVSERVE_CHECK_DEVICE=cpu KVSERVE_CHECK_WHEELS=0 PYTHON=.venv/bin/python OUT=/tmp/cudacheck_out \
#       bash scripts/cuda_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

DEV=${KVSERVE_CHECK_DEVICE:-cuda}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/cuda_check_out}
BUDGET=${KVSERVE_CHECK_BUDGET_S:-330}   # seconds for all steps together
STEPS=${KVSERVE_CHECK_STEPS:-wheels env smoke model tests bench_bf16 bench_fp32}  # a subset reruns less
ASSETS=$PWD/.cuda_assets
SITE=${KVSERVE_CHECK_SITE:-/tmp/site}
MODEL=/tmp/smollm2-random
if [ "$DEV" = cuda ]; then
    BENCH_ARGS=""                                   # the whole w64 workload (64 requests)
    BS_BF16=64,32; BS_FP32=64; KV_GIB=4
else                                                # CPU dry run: just prove every command
    BENCH_ARGS="--num-prompts 3 --output-len 6"
    BS_BF16=3; BS_FP32=3; KV_GIB=0.25
fi
export DEV PY OUT ASSETS SITE MODEL BENCH_ARGS KV_GIB

mkdir -p "$OUT"
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
export KVSERVE_NATIVE=0                              # the C decode kernel is CPU-only: never build it
export KVSERVE_CACHE_DIR=${KVSERVE_CACHE_DIR:-/tmp/kvserve-cache}
export KVSERVE_SHARED_DIR=$ASSETS                    # workloads/w64.jsonl
START=$(date +%s)
RESULTS=()

# step NAME WANT_SECONDS FUNCTION ARGS...: run an exported shell function under min(WANT, budget
# left) seconds; SIGINT first (pytest then still writes its junit file), SIGKILL 15 s later.
step() {
    local name=$1 want=$2; shift 2
    case " $STEPS " in *" $name "*) ;; *) echo "=== [$name] not in KVSERVE_CHECK_STEPS"; return ;; esac
    local left=$((BUDGET - ($(date +%s) - START)))
    local t=$((want < left ? want : left))
    if ((t < 10)); then
        RESULTS+=("$(printf '%-8s %-14s (overall budget of %ss spent)' SKIPPED "$name" "$BUDGET")")
        echo "=== [$name] skipped: budget spent"
        return
    fi
    echo
    echo "=== [$name] at +$(($(date +%s) - START))s, timeout ${t}s: $*"
    local t0 rc verdict
    t0=$(date +%s)
    timeout -s INT -k 15 "$t" bash -c '"$@"' step "$@"
    rc=$?
    if ((rc == 0)); then verdict=OK; elif ((rc == 124 || rc == 137)); then verdict=TIMEOUT; else verdict=FAILED; fi
    RESULTS+=("$(printf '%-8s %-14s rc=%-3s %4ss' "$verdict" "$name" "$rc" "$(($(date +%s) - t0))")")
    echo "=== [$name] $verdict (rc=$rc) in $(($(date +%s) - t0))s"
}

install_wheels() {
    if [ "${KVSERVE_CHECK_WHEELS:-1}" = 0 ]; then echo "wheels: skipped (KVSERVE_CHECK_WHEELS=0)"; return 0; fi
    ls .whl/*.whl || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl \
        && return 0
    echo "pip failed; unpacking the wheels instead"   # a wheel is a zip of the site-packages tree
    "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
        "$SITE" .whl/*.whl
}

env_info() {
    nvidia-smi -L || echo "(no nvidia-smi)"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.max.sm --format=csv || true
    echo "nproc: $(nproc)"
    "$PY" - <<'EOF'
import sys, torch, transformers, tokenizers
print("python", sys.version.split()[0], "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| transformers", transformers.__version__, "| tokenizers", tokenizers.__version__)
print("torch.cuda.is_available():", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device 0:", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0),
          "| matmul allow_tf32:", torch.backends.cuda.matmul.allow_tf32,
          "| float32_matmul_precision:", torch.get_float32_matmul_precision())
EOF
}

smoke() {
    "$PY" - <<'EOF'
import importlib
for m in ("pydantic", "fastapi", "starlette", "uvicorn", "psutil", "gguf", "kvserve",
          "kvserve.entrypoints.openai.api_server", "kvserve.benchmarks.throughput"):
    mod = importlib.import_module(m)
    print(f"import {m}: ok ({getattr(mod, '__version__', '')} {getattr(mod, '__file__', '')})")
import kvserve.ops.attention as na
print("native kernel (must be off here):", na.available(), na.failure_reason())
EOF
}

make_model() {  # written to $MODEL.tmp, then renamed: a rerun on a warm machine reuses it
    if [ -f "$MODEL/model.safetensors" ]; then echo "reusing $MODEL"; ls -la "$MODEL"; return 0; fi
    rm -rf "$MODEL.tmp"
    "$PY" - "$ASSETS/smollm2" "$MODEL.tmp" <<'EOF' && mv "$MODEL.tmp" "$MODEL"
import shutil, sys, time
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
t = time.perf_counter()
cfg = AutoConfig.from_pretrained(src)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
model.save_pretrained(dst)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(src / f, dst / f)
n = sum(p.numel() for p in model.parameters())
print(f"random {cfg.model_type} {n / 1e6:.1f}M params, {cfg.num_hidden_layers} layers -> {dst} "
      f"({time.perf_counter() - t:.1f}s): {sorted(p.name for p in dst.iterdir())}")
EOF
}

golden_tests() {
    KVSERVE_TEST_DEVICE=$DEV KVSERVE_TEST_TOKENIZER_DIR=$ASSETS/smollm2 \
        "$PY" -m pytest -v -rs -m "" -p no:cacheprovider --durations=8 --junitxml="$OUT/junit.xml" \
        tests/model_executor/test_sampler.py tests/worker/test_model_runner.py tests/engine/test_e2e_tiny.py
}

bench() {  # bench DTYPE BATCH_SIZES JSON
    "$PY" -m kvserve.benchmarks.throughput --model "$MODEL" --device "$DEV" --dtype "$1" \
        --workload "$ASSETS/workloads/w64.jsonl" $BENCH_ARGS --kv-cache-memory-gib "$KV_GIB" \
        --baseline-batch-sizes "$2" --no-tqdm --json-out "$3"
}

summary() {
    echo
    echo "=== summary (device $DEV, $(($(date +%s) - START))s of the ${BUDGET}s budget)"
    printf '%s\n' ${RESULTS[@]+"${RESULTS[@]}"}
    "$PY" - "$OUT" <<'EOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path
out = Path(sys.argv[1])
try:
    root = ET.parse(out / "junit.xml").getroot()
    s = root if root.tag == "testsuite" else root.find("testsuite")
    print("tests: {} run, {} failures, {} errors, {} skipped".format(
        s.get("tests"), s.get("failures"), s.get("errors"), s.get("skipped")))
    for case in s.iter("testcase"):
        for kind in ("failure", "error"):
            for e in case.findall(kind):
                print(f"  {kind.upper()}: {case.get('classname')}::{case.get('name')}: "
                      f"{(e.get('message') or '').splitlines()[0][:200] if e.get('message') else ''}")
        if "cuda" in case.get("name", ""):
            print(f"  {case.get('name')}: {'skipped' if case.find('skipped') is not None else 'ran'}")
except Exception as e:
    print("tests: no junit result:", e)
for name in ("bench_bf16.json", "bench_fp32.json"):
    try:
        r = json.loads((out / name).read_text())
    except Exception as e:
        print(f"{name}: no result ({e})")
        continue
    kv = r["kvserve"]
    print(f"{name}: {r['num_requests']} requests, {r['prompt_tokens']} prompt + {r['output_tokens']} output tokens")
    print(f"  kvserve {kv.get('dtype')}: {kv['output_tokens_per_s']:.0f} output tok/s, {kv['elapsed_s']:.2f}s "
          f"(load {kv['load_s']:.1f}s, warm-up {kv['warmup_s']:.1f}s, short {kv['requests_short_of_output_len']}, "
          f"preemptions {kv.get('kv_cache', {}).get('num_preemptions')})")
    for b in r["transformers"]:
        print(f"  transformers bs={b['batch_size']}: {b['output_tokens_per_s']:.0f} output tok/s, {b['elapsed_s']:.2f}s")
    if r.get("ratio_vs_best_transformers"):
        print(f"  kvserve / best transformers: {r['ratio_vs_best_transformers']:.2f}x")
EOF
}

export -f install_wheels env_info smoke make_model golden_tests bench

main() {
    echo "kvserve cuda_check: device=$DEV python=$PY out=$OUT budget=${BUDGET}s commit=$(git rev-parse --short HEAD 2>/dev/null)"
    git status --short 2>/dev/null | head -20
    step wheels 60 install_wheels
    step env 60 env_info
    step smoke 60 smoke
    step model 120 make_model
    step tests 150 golden_tests
    step bench_bf16 150 bench bfloat16 "$BS_BF16" "$OUT/bench_bf16.json"
    step bench_fp32 100 bench float32 "$BS_FP32" "$OUT/bench_fp32.json"
    summary | tee "$OUT/summary.txt"
    local r
    for r in ${RESULTS[@]+"${RESULTS[@]}"}; do [[ $r == OK* ]] || return 1; done  # 1: a step not OK
}

main 2>&1 | tee "$OUT/cuda_check.log"
exit "${PIPESTATUS[0]}"
