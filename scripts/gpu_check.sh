#!/usr/bin/env bash
# The device checks that CI (no GPU) cannot run, as one script for a session that is
# lent a CUDA machine: the GPU-marked tests (Triton kernels against the torch reference,
# the CUDA engine against transformers, the engine core's exactness with a CUDA runner),
# the in-process throughput on the device beside transformers on the same device, and
# the tensor-parallel benchmark: a short TP=2 run on the machine's CPUs, then, where the
# machine has two GPUs or more, TP=1 against TP=2 on them (TP=2 needs two devices).
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
export PYTHONUNBUFFERED=1 PYTHONPATH=".:protos:kernels${PYTHONPATH:+:$PYTHONPATH}"
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
  run timeout 240 python3 benchmarks/tensor_parallel.py --hidden 512 --layers 4 --vocab 8192 \
    --batch 8 --steps 16 --rounds 1 --repeats 50
  if (( $(nvidia-smi -L | wc -l) >= 2 )); then
    run timeout 300 python3 benchmarks/tensor_parallel.py --device cuda --parts throughput
  else
    echo "=== skipped: benchmarks/tensor_parallel.py --device cuda (needs 2 GPUs)"
  fi
  echo "=== exit status $status"
  return "$status"
}
main 2>&1 | tee "$log_dir/gpu_check.log"
exit "${PIPESTATUS[0]}"
