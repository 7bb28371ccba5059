#!/usr/bin/env bash
# The prepared device run (an H200 or any CUDA GPU), short enough for a 15-minute loan:
#   bash scripts/gpu_bench.sh            # results in $OUT (default bench_results/): .txt tables and .json
# Real-size random-weight SD3.5-Medium and FLUX.1-dev transformers + VAEs in bf16 with SDPA: our ODE / SDE
# rollouts against pipe(), one LoRA training step, peak memory; then the tiny pipelines on CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_results}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
pip install -q -e . 2>&1 | tail -n 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
run() { local name=$1; shift; timeout 420 python scripts/bench.py "$@" --json "$OUT/$name.json" | tee "$OUT/$name.txt"; }
run rollout_real_sd3 rollout --real-size --kind sd3 --steps 10 --batch 4 --size 512 --repeats 3
run rollout_real_flux rollout --real-size --kind flux --steps 6 --batch 2 --size 512 --repeats 3 --gradient-checkpointing
run rollout_tiny_cuda rollout --repeats 5
if python -c "import xformers" 2>/dev/null; then
  run rollout_real_sd3_xformers rollout --real-size --kind sd3 --steps 10 --batch 4 --size 512 --repeats 3 --attention xformers
fi
