#!/usr/bin/env bash
# The device checks that CI (no GPU) cannot run, as one script for a session that is
# lent a CUDA machine: the GPU-marked tests (Triton kernels against the torch reference,
# the CUDA engine against transformers, the engine core's exactness with a CUDA runner)
# and the in-process throughput on the device beside transformers on the same device.
#
#   bash scripts/gpu_check.sh [LOG_DIR]      # LOG_DIR defaults to $OUT, else /tmp
#
# It uses the machine's own python3 and torch (nothing is installed), which is why it
# leaves out the gRPC cluster: the serving packages (grpcio-health-checking, -reflection,
# -status, opentelemetry) are not on the device image. Well under 10 minutes on one H200.
set -uo pipefail
cd "$(dirname "$0")/.."
log_dir=${1:-${OUT:-/tmp}}
mkdir -p "$log_dir"
export PYTHONUNBUFFERED=1 PYTHONPATH=".:protos${PYTHONPATH:+:$PYTHONPATH}"
status=0
run() {
  echo "=== $*"
  "$@" || { echo "=== FAILED ($?): $*"; status=1; }
}
main() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())'
  run timeout 300 python3 -m pytest -q -p no:cacheprovider -m "not slow" tests/kernels
  run timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/kernels
  run timeout 300 python3 benchmarks/throughput.py --device cuda --skip-cluster
  echo "=== exit status $status"
  return "$status"
}
main 2>&1 | tee "$log_dir/gpu_check.log"
exit "${PIPESTATUS[0]}"
