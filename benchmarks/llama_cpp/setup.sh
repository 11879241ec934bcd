#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (the llama.cpp peer of `benchmarks/quantized.py --peer llama.cpp`)
# from the `llama-cpp-python` sdist, which vendors a full llama.cpp tree under vendor/llama.cpp.
#
#   bash benchmarks/llama_cpp/setup.sh                 # -> ~/.cache/kvserve-bench/llama.cpp-<ver>/bin/llama-server
#   LLAMA_CPP_PYTHON_VERSION=0.3.36 LLAMA_CPP_CACHE=/some/dir bash benchmarks/llama_cpp/setup.sh
#   JOBS=4 bash benchmarks/llama_cpp/setup.sh          # parallel compile jobs (default 2)
#
# Idempotent: does nothing when the binary is already there (delete the folder to rebuild).
# Kept outside the repository: the sdist and the build tree are a few hundred MiB.
#
# Build options: GGML_NATIVE=OFF (a native build died with SIGILL at warm-up on hosts that list AMX),
# and each x86 extension (SSE4.2, AVX, AVX2, BMI2, FMA, F16C, AVX-512F, AVX-512 VBMI / VNNI / BF16)
# switched on only when /proc/cpuinfo lists it; AMX always off. No libcurl and no OpenSSL (the
# model is a local file, the server listens on 127.0.0.1). Static libraries: one binary to copy.
set -euo pipefail

VER="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE="${LLAMA_CPP_CACHE:-$HOME/.cache/kvserve-bench}"
PREFIX="$CACHE/llama.cpp-$VER"
JOBS="${JOBS:-2}"
PYTHON="${PYTHON:-python3}"
BIN="$PREFIX/bin/llama-server"

if [ -x "$BIN" ]; then
    echo "[llama.cpp setup] already built: $BIN"
    exit 0
fi
mkdir -p "$PREFIX"
# One build at a time: a second setup.sh waits for the first instead of compiling alongside it.
exec 9>"$PREFIX/.build.lock"
if ! flock -n 9; then
    echo "[llama.cpp setup] another build holds $PREFIX/.build.lock; waiting" >&2
    flock 9
fi
if [ -x "$BIN" ]; then
    echo "[llama.cpp setup] already built: $BIN"
    exit 0
fi

SRC="$PREFIX/src"
if [ ! -f "$SRC/vendor/llama.cpp/CMakeLists.txt" ]; then
    echo "[llama.cpp setup] downloading the llama-cpp-python==$VER sdist"
    DL="$PREFIX/download"
    mkdir -p "$DL"
    [ -f "$DL/llama_cpp_python-$VER.tar.gz" ] || "$PYTHON" -m pip download --no-deps --no-binary llama-cpp-python -d "$DL" \
        "llama-cpp-python==$VER" >/dev/null
    TARBALL=""
    for f in "$DL"/llama_cpp_python-"$VER".tar.gz "$DL"/llama-cpp-python-"$VER".tar.gz; do
        [ -f "$f" ] && TARBALL="$f" && break
    done
    [ -n "$TARBALL" ] || { echo "[llama.cpp setup] sdist not found in $DL" >&2; exit 1; }
    rm -rf "$SRC" && mkdir -p "$SRC"
    tar -xzf "$TARBALL" -C "$SRC" --strip-components=1
fi

has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
AVX512="$(has avx512f)"
FLAGS=(
    -DCMAKE_BUILD_TYPE=Release
    -DBUILD_SHARED_LIBS=OFF
    -DGGML_NATIVE=OFF
    -DGGML_SSE42="$(has sse4_2)"
    -DGGML_AVX="$(has avx)"
    -DGGML_AVX2="$(has avx2)"
    -DGGML_BMI2="$(has bmi2)"
    -DGGML_FMA="$(has fma)"
    -DGGML_F16C="$(has f16c)"
    -DGGML_AVX512="$AVX512"
    -DGGML_AVX512_VBMI="$(has avx512vbmi)"
    -DGGML_AVX512_VNNI="$(has avx512_vnni)"
    -DGGML_AVX512_BF16="$(has avx512_bf16)"
    -DGGML_AVX_VNNI=OFF
    -DGGML_AMX_TILE=OFF
    -DGGML_AMX_INT8=OFF
    -DGGML_AMX_BF16=OFF
    -DLLAMA_CURL=OFF
    -DLLAMA_OPENSSL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_SERVER=ON
)
echo "[llama.cpp setup] cmake ${FLAGS[*]}"
BUILD="$PREFIX/build"
nice -n 10 cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" "${FLAGS[@]}" >"$PREFIX/cmake.log" 2>&1 \
    || { tail -30 "$PREFIX/cmake.log" >&2; exit 1; }
echo "[llama.cpp setup] building llama-server with -j$JOBS (log: $PREFIX/build.log)"
nice -n 10 cmake --build "$BUILD" --target llama-server -j "$JOBS" >"$PREFIX/build.log" 2>&1 \
    || { tail -30 "$PREFIX/build.log" >&2; exit 1; }
mkdir -p "$PREFIX/bin"
cp "$BUILD/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
printf '%s\n' "llama-cpp-python==$VER" "${FLAGS[@]}" >"$PREFIX/build-info.txt"
"$BIN" --version 2>&1 | head -3 || true
echo "[llama.cpp setup] done: $BIN"
