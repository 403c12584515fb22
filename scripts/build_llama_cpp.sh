#!/usr/bin/env bash
# Build llama.cpp's own tools (llama-server, llama-quantize, llama-perplexity, llama-bench) from source, since no
# binary can be downloaded here. The sources are the ones vendored in the llama-cpp-python sdist on PyPI, so the
# build matches the llama.cpp that scripts/bench_baseline.py drives through llama-cpp-python.
#
#   scripts/build_llama_cpp.sh [DEST]        # DEST defaults to $TPSERVE_HOME/llama.cpp (~/.cache/tpserve/llama.cpp)
#   LLAMA_CPP_ISA=avx2 scripts/build_llama_cpp.sh   # AVX2 + FMA only (no AVX-512), into $TPSERVE_HOME/llama.cpp-avx2
#
# The AVX2 build is the anchor for tpserve's x86-64-v3 kernels (TPSERVE_KERNELS=x86-64-v3): llama.cpp built for the
# ISA of a Zen 2/3 or Intel client CPU, runnable on any host that has AVX2. The benchmark scripts take the build from
# LLAMA_CPP_DIR (default $TPSERVE_HOME/llama.cpp).
#
# Needs cmake, ninja (or make) and a C++ compiler; about 6-8 minutes on 2 cores. Built with -march=native (GGML_NATIVE),
# as a llama.cpp user building on their own machine would. Prints the bin directory at the end.
set -euo pipefail
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
HOME_DIR="${TPSERVE_HOME:-$HOME/.cache/tpserve}"
ISA="${LLAMA_CPP_ISA:-native}"
case "$ISA" in
    native) DEST="${1:-$HOME_DIR/llama.cpp}"; ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
    avx2) DEST="${1:-$HOME_DIR/llama.cpp-avx2}"
          ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF
                     -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
    *) echo "LLAMA_CPP_ISA must be native or avx2, not $ISA" >&2; exit 2 ;;
esac
PY="${PYTHON:-python3}"
TARGETS=(llama-server llama-quantize llama-perplexity llama-bench)

if [ -x "$DEST/bin/llama-server" ] && [ -x "$DEST/bin/llama-quantize" ] && [ -x "$DEST/bin/llama-perplexity" ]; then
    echo "$DEST/bin"; exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --no-binary :all: --no-deps -d "$work" "llama-cpp-python==$VERSION" >&2
tar -xzf "$work"/llama_cpp_python-"$VERSION".tar.gz -C "$work"
src="$work/llama_cpp_python-$VERSION/vendor/llama.cpp"
gen=()
command -v ninja >/dev/null && gen=(-G Ninja)
cmake -S "$src" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >&2
cmake --build "$work/build" --config Release -j "$(nproc)" --target "${TARGETS[@]}" >&2
mkdir -p "$DEST/bin"
for t in "${TARGETS[@]}"; do cp "$work/build/bin/$t" "$DEST/bin/"; done
echo "$VERSION $ISA" > "$DEST/VERSION"
echo "$DEST/bin"
