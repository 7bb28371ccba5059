#!/usr/bin/env bash
# The prepared device run: one CUDA GPU (an H200), at most 8 minutes.
#   bash scripts/gpu_bench.sh                                      # results in $OUT (default bench_results/)
#   bash scripts/gpu_bench.sh --device cpu --layers 1 --size 256   # smoke run of the same path on a CPU (minutes)
#
# 1. The GPU section of docs/benchmarks.md (python scripts/bench.py gpu): random-weight real-size SD3.5-Medium
#    (10 steps, CFG 4.5, batch 8) and FLUX.1-dev (6 steps, batch 8) at 512 px in bf16 with LoRA r32: rollout images/s
#    (our SDE rollout, against our ODE rollout and pipe()), seconds per trained step (without / with gradient
#    checkpointing), peak memory and MFU against the dense bf16 peak (989 TFLOP/s on an H200), FLOPs counted from the
#    configs on the meta device. Written to $OUT/benchmarks.md: a copy of docs/benchmarks.md with that section
#    replaced (copy it over docs/benchmarks.md), and $OUT/gpu*.json / .txt.
# 2. While time is left (each step skipped when it would not fit): model.compile's train step and the xformers
#    attention backend (when installed) on SD3.5-M, into the same section; the tiny train-step and memory
#    benchmarks on CUDA; the trainer under the single-GPU, DeepSpeed ZeRO-2 and FSDP2 launch configs (one process
#    each).
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=cuda
SIZE=512
LAYERS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --size) SIZE=$2; shift 2 ;;
    --layers) LAYERS=(--layers "$2"); shift 2 ;;
    *) echo "unknown option $1 (expected --device, --size, --layers)" >&2; exit 2 ;;
  esac
done
OUT="${OUT:-bench_results}"
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
BUDGET=${BUDGET:-480}  # seconds for the whole script
left() { echo $((BUDGET - SECONDS)); }
# run NAME SECONDS ARGS...: a benchmark with a time limit, its table in $OUT/NAME.txt and results in $OUT/NAME.json
run() {
  local name=$1 limit=$2; shift 2
  if [ "$(left)" -lt "$limit" ]; then echo "skipped $name: $(left) s left, it may take $limit s"; return 1; fi
  if timeout "$limit" python scripts/bench.py "$@" --json "$OUT/$name.json" > "$OUT/$name.txt" 2>&1; then
    echo "$name: ok ($SECONDS s so far)"; cat "$OUT/$name.txt" | grep -v "^There are modules" | tail -n 25
  else
    echo "$name: FAILED or timed out after $limit s, see $OUT/$name.txt"; tail -n 5 "$OUT/$name.txt"; return 1
  fi
}

if [ "$DEVICE" = cpu ]; then  # smoke run: the same code path, tiny batch and steps
  GPU=(gpu --device cpu --size "$SIZE" "${LAYERS[@]}" --batch 1 --steps 2 --repeats 1)
  LIMIT_SD3=900; LIMIT_FLUX=900; BUDGET=${BUDGET_SMOKE:-1800}
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  GPU=(gpu --device "$DEVICE" --size "$SIZE" "${LAYERS[@]}" --batch 8 --repeats 3)
  LIMIT_SD3=150; LIMIT_FLUX=210
fi

# 1. The GPU section.
cp docs/benchmarks.md "$OUT/benchmarks.md" 2>/dev/null || true
run gpu_sd3 "$LIMIT_SD3" "${GPU[@]}" --kind sd3
run gpu_flux "$LIMIT_FLUX" "${GPU[@]}" --kind flux
parts=()
for name in gpu_sd3 gpu_flux; do [ -s "$OUT/$name.json" ] && parts+=("$OUT/$name.json"); done
if [ "$DEVICE" != cpu ] && [ "$(left)" -ge 150 ]; then  # model.compile on SD3.5-M (compilation: a minute or two)
  run gpu_sd3_compile 140 "${GPU[@]}" --kind sd3 --no-rollout --train compile --repeats 2 && parts+=("$OUT/gpu_sd3_compile.json")
fi
if [ "$DEVICE" != cpu ] && python -c "import xformers" 2>/dev/null && [ "$(left)" -ge 120 ]; then  # optional backend
  run gpu_sd3_xformers 100 "${GPU[@]}" --kind sd3 --attention xformers --train no-checkpointing \
    && parts+=("$OUT/gpu_sd3_xformers.json")
fi
if [ ${#parts[@]} -gt 0 ]; then
  python scripts/bench.py gpu --merge "${parts[@]}" --doc "$OUT/benchmarks.md" --json "$OUT/gpu.json" > "$OUT/gpu_tables.txt" \
    && echo "GPU section written to $OUT/benchmarks.md"
fi
[ "$DEVICE" = cpu ] && exit 0

# 2. With the time that is left.
run train_step_cuda 60 train-step --device cuda --repeats 5 --variants fp32,gradient\ checkpointing,bf16
run memory_cuda 70 memory --device cuda --no-compile
train() {
  local name=$1; shift
  if [ "$(left)" -lt 70 ]; then echo "skipped train $name: $(left) s left"; return; fi
  if timeout 65 accelerate launch "$@" --num_processes 1 scripts/train.py --config configs/tiny_sd3.yaml \
      run.output_dir="$OUT/train_$name" run.epochs=2 run.progress=false eval.every=1 checkpoint.every=1 \
      > "$OUT/train_$name.txt" 2>&1; then echo "train $name: ok"; else echo "train $name: FAILED, see $OUT/train_$name.txt"; fi
}
train single --config_file configs/accelerate/single_gpu.yaml
train zero2 --config_file configs/accelerate/deepspeed_zero2.yaml
train fsdp2 --config_file configs/accelerate/fsdp.yaml
echo "done in $SECONDS s"
