#!/usr/bin/env bash
# Generates Python code (messages, gRPC stubs, typing stubs) for proto/pdserve/v1 into OUT_DIR.
# `make proto` writes into the repository; `make test` generates into a temporary directory and
# fails if the checked-in code differs (stale gencode).
set -euo pipefail
out=${1:-.}
top=$(cd "$(dirname "$0")/.." && pwd)
bin=$(dirname "$(command -v python)")
cd "$top"
PATH="$bin:$PATH" python -m grpc_tools.protoc -Iproto \
  --python_out="$out" --grpc_python_out="$out" --mypy_out="$out" --mypy_grpc_out="$out" \
  proto/pdserve/v1/*.proto 2> >(grep -v "^Writing mypy" >&2)
