#!/usr/bin/env bash
# The prepared device run (an H200 or any CUDA GPU), short enough for a 15-minute loan:
#   bash scripts/gpu_bench.sh            # results in $OUT (default bench_results/): .txt tables and .json
# Real-size random-weight SD3.5-Medium and FLUX.1-dev transformers + VAEs in bf16 with SDPA: our ODE / SDE
# rollouts against pipe(), one LoRA training step, peak memory; then the tiny pipelines on CUDA, and the trainer
# on CUDA under the single-GPU, DeepSpeed ZeRO-2 and FSDP2 launch configs (one process each, NCCL).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench_results}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1
pip install -q -e ".[deepspeed]" 2>&1 | tail -n 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
run() { local name=$1; shift; timeout 420 python scripts/bench.py "$@" --json "$OUT/$name.json" | tee "$OUT/$name.txt"; }
run rollout_real_sd3 rollout --real-size --kind sd3 --steps 10 --batch 4 --size 512 --repeats 3
run rollout_real_flux rollout --real-size --kind flux --steps 6 --batch 2 --size 512 --repeats 3 --gradient-checkpointing
run rollout_tiny_cuda rollout --repeats 5
if python -c "import xformers" 2>/dev/null; then
  run rollout_real_sd3_xformers rollout --real-size --kind sd3 --steps 10 --batch 4 --size 512 --repeats 3 --attention xformers
fi

train() {
  local name=$1; shift
  if timeout 180 accelerate launch "$@" --num_processes 1 scripts/train.py --config configs/tiny_sd3.yaml \
      run.output_dir="$OUT/train_$name" run.epochs=2 run.progress=false eval.every=1 checkpoint.every=1 \
      > "$OUT/train_$name.txt" 2>&1; then echo "train $name: ok"; else echo "train $name: FAILED, see $OUT/train_$name.txt"; fi
}
train single --config_file configs/accelerate/single_gpu.yaml
train zero2 --config_file configs/accelerate/deepspeed_zero2.yaml
train fsdp2 --config_file configs/accelerate/fsdp.yaml
