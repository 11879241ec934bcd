# Source me: the environment vLLM's CPU backend needs for fair runs on this machine.
#   VLLM_VENV=/work/vllm-venv source benchmarks/vllm_cpu/env.sh
# - VLLM_CPU_OMP_THREADS_BIND=0-1 and VLLM_CPU_NUM_OF_RESERVED_CPU=0: use both cores (by default
#   vLLM reserves one CPU for its frontend and runs on the other, ~40% slower on a 2-core box).
#   Override VLLM_CPU_OMP_THREADS_BIND for other machines (e.g. 0-7).
# - LD_PRELOAD: Debian's tcmalloc (libtcmalloc-minimal4) and the Intel OpenMP runtime bundled in
#   the venv (libiomp5.so), as vLLM's CPU docs ask.
# - VLLM_CPU_KVCACHE_SPACE: KV cache size in GiB (default here 4).
VLLM_VENV="${VLLM_VENV:-/work/vllm-venv}"
export VLLM_VENV
export VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-0-$(( $(nproc) - 1 ))}"
export VLLM_CPU_NUM_OF_RESERVED_CPU="${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}"
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-4}"
_kv_tcmalloc="$(ldconfig -p 2>/dev/null | awk '/libtcmalloc_minimal\.so\.4 /{print $NF; exit}')"
[ -z "$_kv_tcmalloc" ] && [ -e /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 ] && \
    _kv_tcmalloc=/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4
_kv_iomp="$(find "$VLLM_VENV" -name 'libiomp5.so' -print -quit 2>/dev/null)"
[ -z "$_kv_tcmalloc" ] && echo "[vllm env] warning: libtcmalloc_minimal.so.4 not found (apt-get install -y libtcmalloc-minimal4)" >&2
[ -z "$_kv_iomp" ] && echo "[vllm env] warning: libiomp5.so not found under $VLLM_VENV" >&2
case ":${LD_PRELOAD:-}:" in
    *libtcmalloc_minimal*) ;;
    *) export LD_PRELOAD="${_kv_tcmalloc}${_kv_iomp:+:$_kv_iomp}${LD_PRELOAD:+:$LD_PRELOAD}";;
esac
export KVSERVE_VLLM_ENV=1
unset _kv_tcmalloc _kv_iomp
