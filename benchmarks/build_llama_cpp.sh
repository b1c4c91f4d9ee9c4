#!/usr/bin/env bash
# Build llama.cpp's llama-batched-bench and llama-server (CPU only) from the
# llama.cpp tree vendored in the llama-cpp-python sdist on PyPI, as an external
# baseline for specstack benchmarks. Re-runnable: steps already done are skipped.
#
#   usage: benchmarks/build_llama_cpp.sh [DIR]   (default: $HOME/.cache/specstack/llama_cpp)
#   env:   LLAMA_CPP_PY_VERSION (default 0.3.36), JOBS (default 2),
#          LLAMA_CPP_EXTRA (more targets, e.g. "llama-speculative llama-bench llama-lookup")
set -euo pipefail

DIR="${1:-$HOME/.cache/specstack/llama_cpp}"
VER="${LLAMA_CPP_PY_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
SRC="$DIR/llama_cpp_python-$VER/vendor/llama.cpp"
BUILD="$DIR/build"
BIN="$BUILD/bin"
mkdir -p "$DIR"

# 1. Fetch the sdist only (never a wheel) and unpack it.
if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
    sdist="$DIR/llama_cpp_python-$VER.tar.gz"
    [[ -f "$sdist" ]] || python3 -m pip download --no-deps --no-binary :all: \
        "llama-cpp-python==$VER" -d "$DIR"
    tar -xzf "$sdist" -C "$DIR"
fi

# 2. Configure. Why these flags:
#  - the instruction sets come from specstack/bench/llama_build.py (one place, unit-tested, the flags a
#    llama-cpp-python must be built with too): GGML_NATIVE=OFF, each ISA named, AVX-512 only where this
#    CPU has it, AMX always off (the native build turns AMX on some of our CPUs and crashes).
#  - LLAMA_BUILD_UI=OFF, LLAMA_USE_PREBUILT_UI=OFF: otherwise the server build
#    downloads the web UI from Hugging Face at build time (we only use the API).
#  - LLAMA_OPENSSL=OFF, BUILD_SHARED_LIBS=OFF: no HTTPS needed; static binaries
#    can be copied/run without libllama.so next to them.
#  - (LLAMA_CURL is deprecated in this llama.cpp version, so it is not passed.)
if [[ ! -f "$BUILD/CMakeCache.txt" ]]; then
    # shellcheck disable=SC2207
    isa=($(cd "$(dirname "$0")/.." && python3 -m specstack.bench.llama_build))
    gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
    cmake -S "$SRC" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF "${isa[@]}" \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_OPENSSL=OFF
fi

# 3. Build only the binaries we need (~7-10 min on 2 cores; no-op if up to date). The speculative
#    peers of `specstack bench` (llamacpp-spec, llamacpp-pld) need LLAMA_CPP_EXTRA's targets.
# shellcheck disable=SC2086
cmake --build "$BUILD" --target llama-batched-bench llama-server ${LLAMA_CPP_EXTRA:-} -j "$JOBS"

echo "$BIN/llama-batched-bench"
echo "$BIN/llama-server"
for t in ${LLAMA_CPP_EXTRA:-}; do echo "$BIN/$t"; done
