#!/usr/bin/env bash
# Regenerate the Python code beside every .proto with the pinned grpcio-tools: ours and
# the vendored third-party ones under corestream/vendor/ (see the README there).
set -euo pipefail
py="${PYTHON:-python}"
case "$py" in */*) py="$(cd "$(dirname "$py")" && pwd)/$(basename "$py")" ;; esac
cd "$(dirname "$0")"
mapfile -t files < <(find corestream -name '*.proto' | sort)
"$py" -m grpc_tools.protoc -I. --python_out=. --pyi_out=. --grpc_python_out=. "${files[@]}"
