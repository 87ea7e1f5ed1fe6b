#!/usr/bin/env bash
# The accelerator checks, in one pass: the rollout, attention, SFT-step and
# DiffusionGemma-sampler benchmarks,
# then (given a finished `benchmarks/convert_code.py --out RUN`) the converted
# models re-timed against their AR peer by `benchmarks/convert_speed.py`.
#
#   bash tools/gpu_bench.sh [RUN [STAGES]]      # logs under $OUT (or gpu_out)
#   STEPS="sft_step" bash tools/gpu_bench.sh    # some of the benchmarks only
#
# Each step has its own time limit, so one that fails or hangs still leaves
# the others' figures. Run from the repository root with the package
# importable (`pip install -e .` or PYTHONPATH).
set -u
out=${OUT:-gpu_out}
run=${1:-}
stages=${2:-sft,sft_kd_certainty}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total \
    --format=csv 2>&1
  python3 -c "import jax, flax; print('jax', jax.__version__, 'flax',
flax.__version__, jax.devices())"
} 2>&1 | tee "$out/machine.txt"
step() {  # step NAME SECONDS COMMAND...
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  echo "== $name: rc $? in $((SECONDS - start)) s" | tee -a "$out/machine.txt"
}
steps=" ${STEPS:-rollout attention sft_step diffusion_gemma_sampler} "
for name in rollout attention sft_step diffusion_gemma_sampler; do
  [[ $steps == *" $name "* ]] && step "$name" 150 python3 "benchmarks/$name.py"
done
if [[ -n $run ]]; then
  step convert_speed 240 python3 benchmarks/convert_speed.py "$run" \
    --stages "$stages" --batch 32,128 --repeats 5
  cp "$run"/speed_*.json "$out/" 2>/dev/null
fi
for log in "$out"/*.log; do
  echo "### $log"
  grep -E '^\||^Tiny|^Held|^## ' "$log" || tail -5 "$log"
done
