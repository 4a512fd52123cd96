#!/usr/bin/env bash
# One short device check (about 9 minutes on one GPU, each step under its own timeout):
#   1. the accuracy grid measured with max_memory_allocated (benchmarks/accuracy.py --quick);
#   2. a plan solved for the h200 profile, its knobs re-planned at a bounded length, and run for
#      real (the executor records per step max_memory_allocated/reserved and, over steps 4-5,
#      the kernel time split);
#   3. the overlapped step time and memory of a 2-block tiny-llama under FSDP2 (ZeRO-3),
#      predicted for h200 beside measured, and h200 refit from it (benchmarks/gpu_step.py:
#      gpu_step.csv, gpu_step.json, h200-calibrated.toml);
#   4. `trainplan calibrate` on the run of step 2 (the GPU refit: h200-calibrated-run.toml);
#   5. a profile file used as --hw: the one refit in step 3 where there is one, else a template;
#   6. the long-context knobs (tiled loss, tiled MLP, activation offload) run on the device
#      (benchmarks/long_context.py: offload's device saving predicted beside measured).
# Results go to benchmarks/results/gpu-<date>-<device>/ (GPU_CHECK_OUT=DIR to choose; with
# GPU_CHECK_TAR=FILE also one .tar.gz of it). A failed step is named at the end (exit 1); the
# others still run. Without a CUDA/ROCm device it says so and exits 3; GPU_CHECK_DRY=1 runs the
# same steps on the CPU, smaller (results in /tmp/gpu_check-dry unless GPU_CHECK_OUT), to test
# the script itself. GPU_CHECK_SETUP=0 skips scripts/_setup.sh (no network there: the python3
# whose packages are installed, this checkout on PYTHONPATH).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${GPU_CHECK_SETUP:-1}" = "1" ]; then
  source scripts/_setup.sh
  PY=python
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  PY=python3
fi
dry="${GPU_CHECK_DRY:-0}"
device=$("$PY" -c "import torch; a = torch.accelerator.current_accelerator(check_available=True); print(a.type if a else 'cpu')")
if [ "$device" = "cpu" ] && [ "$dry" != "1" ]; then
  echo "gpu_check: torch sees no CUDA/ROCm device here (set GPU_CHECK_DRY=1 to run on the CPU)" >&2
  exit 3
fi
name=$("$PY" -c "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')" | tr ' /' '--')
if [ "$dry" = "1" ]; then
  out="${GPU_CHECK_OUT:-${TMPDIR:-/tmp}/gpu_check-dry}"
  seq=256; plan_args=(8 2)     # steps, largest micro-batch: enough for every measured step
  step_args=(--seq-len 256 --micro-batch 2 --steps 8)
else
  out="${GPU_CHECK_OUT:-benchmarks/results/gpu-$(date -u +%Y%m%d)-${name}}"
  seq=1024; plan_args=(300 0)  # at most 300 steps (seconds of tiny-llama on one GPU), the solved micro-batch
  step_args=(--seq-len 1024 --micro-batch 8 --steps 12)
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
failed=()
"$PY" -c "import torch, json; print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, 'hip': torch.version.hip, 'device': '$name', 'dry_run': '$dry' == '1'}))" > "$out/env.json"

# 1. accuracy grid on the device (single process, fp32 so bytes compare exactly)
timeout 360 "$PY" benchmarks/accuracy.py --quick --hw h200 --device "$device" --out "$out" | tee "$out/accuracy.log" \
  || failed+=("1-accuracy")

# 2. a plan for the h200 profile, solved, re-planned at a bounded length, run for real
"$PY" -m trainplan solve --model tiny-llama --hw h200 --seq-len "$seq" --budget-seconds 45 --json "$out/plan-h200.json" \
  | tee "$out/solve.log"
"$PY" benchmarks/gpu_step.py --bounded-plan "$out/plan-h200.json" "${plan_args[@]}"
timeout 300 "$PY" -m trainplan run "$out/plan-h200.json" --out "$out/run-h200" --device "$device" --overwrite \
  --checkpoint-every 0 | tee "$out/run.log" || failed+=("2-run")

# 3. the overlapped FSDP2 step of a 2-block tiny-llama, predicted for h200 beside measured
timeout 300 "$PY" benchmarks/gpu_step.py --hw h200 --device "$device" --out "$out" "${step_args[@]}" \
  | tee "$out/gpu_step.log" || failed+=("3-gpu_step")

# 4. the GPU refit of h200 from the run of step 2 (on a CPU: nothing to refit, it says so); in a
#    cache of its own, so that a loss law fitted from these short runs stays out of the user's
TRAINPLAN_CACHE_DIR="$out/cache" "$PY" -m trainplan calibrate "$out/run-h200" --hw h200 --profile-out "$out/h200-calibrated-run.toml" \
  | tee "$out/calibrate.log" || failed+=("4-calibrate")

# 5. a profile file as --hw: the one refit in step 3, else a template of h200
profile="$out/h200-calibrated.toml"
if [ ! -f "$profile" ]; then
  profile="$out/h200-template.toml"
  "$PY" -m trainplan profiles --template h200 > "$profile"
fi
"$PY" -m trainplan solve --model tiny-llama --hw "$profile" --seq-len "$seq" --budget-seconds 45 \
  | tee "$out/solve-profile-file.log" || failed+=("5-solve-hw-file")

# 6. the long-context knobs on the device: tiled loss, tiled MLP and activation offload (pinned host
#    memory, side stream) planned for h200 at fp32 and run; offload's device saving predicted beside
#    max_memory_allocated (benchmarks/long_context.py: long_context.csv/.json). On a CPU (dry run):
#    the cpu profile, where offload frees nothing.
lc_hw=h200; [ "$device" = "cpu" ] && lc_hw=cpu
timeout 300 "$PY" benchmarks/long_context.py --hw "$lc_hw" --device "$device" --out "$out" \
  | tee "$out/long_context.log" || failed+=("6-long_context")

if [ -n "${GPU_CHECK_TAR:-}" ]; then
  tar -czf "$GPU_CHECK_TAR" -C "$(dirname "$out")" "$(basename "$out")"
fi
echo "gpu_check: results in $out"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu_check: failed steps: ${failed[*]}" >&2
  exit 1
fi
