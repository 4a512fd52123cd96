#!/usr/bin/env bash
# One short device check (under 8 minutes on one GPU): the accuracy grid measured with
# torch.cuda.max_memory_allocated, then a plan solved for the h200 profile and run for real.
# Results go to benchmarks/results/gpu-<date>-<device>/. Without a CUDA/ROCm device it says so
# and exits 3; GPU_CHECK_DRY=1 runs the same steps on the CPU (to test the script itself).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_setup.sh
device=cuda
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  if [ "${GPU_CHECK_DRY:-0}" != "1" ]; then
    echo "gpu_check: torch sees no CUDA/ROCm device here (set GPU_CHECK_DRY=1 to run on the CPU)" >&2
    exit 3
  fi
  device=cpu
fi
name=$(python -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" | tr ' /' '--')
out="benchmarks/results/gpu-$(date -u +%Y%m%d)-${name}"
mkdir -p "$out"
python -c "import torch, json; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'hip': torch.version.hip, 'device': '$name'}))" > "$out/env.json"
# 1. accuracy grid on the device (single process, fp32 so bytes compare exactly)
timeout 360 python benchmarks/accuracy.py --quick --hw h200 --device "$device" --out "$out" | tee "$out/accuracy.log"
# 2. a plan for the h200 profile, solved and run for real on the device
trainplan solve --model tiny-llama --hw h200 --seq-len 1024 --budget-seconds 45 --json "$out/plan-h200.json" | tee "$out/solve.log"
timeout 150 trainplan run "$out/plan-h200.json" --out "$out/run-h200" --device "$device" --overwrite | tee "$out/run.log"
echo "gpu_check: results in $out"
