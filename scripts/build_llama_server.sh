#!/usr/bin/env bash
# Build llama.cpp's own server, `llama-server`, its quantizer, `llama-quantize` (which
# `radixrt bench --model-shape` uses), its tokenizer, `llama-tokenize` (the tests compare
# radixrt's tokens with its), and its two benchmarks, `llama-bench` and
# `test-backend-ops` (which `radixrt bench --workload kernels` runs beside its own GEMM), from the
# llama.cpp sources that the llama-cpp-python source distribution vendors (the same llama.cpp as
# the Python peer), into DEST.
#   bash scripts/build_llama_server.sh VERSION DEST      (about 7 minutes on 2 cores)
# LLAMA_CMAKE_FLAGS adds CMake options: on an AMX host whose llama.cpp AMX kernels fault (this
# version's did on 2026-12-05: SIGILL in tileloadd), the best path that runs is taken with
#   LLAMA_CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
#   -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON"
set -euo pipefail
version=$1
dest=$2
pip=${PIP:-$dest/pip}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$pip" download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$work"
tar xzf "$work"/llama_cpp_python-"$version".tar.gz -C "$work"
cmake -S "$work/llama_cpp_python-$version/vendor/llama.cpp" -B "$work/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    ${LLAMA_CMAKE_FLAGS:-} >/dev/null
targets=(llama-server llama-quantize llama-tokenize llama-bench test-backend-ops)
cmake --build "$work/build" --target "${targets[@]}" -j "$(nproc)"
mkdir -p "$dest"
# llama-tokenize last: the Makefile takes it as the sign that every tool is there
for t in "${targets[@]}"; do
    [ "$t" = llama-tokenize ] || install -m 755 "$work/build/bin/$t" "$dest/$t"
done
install -m 755 "$work/build/bin/llama-tokenize" "$dest/llama-tokenize"
echo "built ${targets[*]} into $dest"
