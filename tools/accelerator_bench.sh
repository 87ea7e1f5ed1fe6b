#!/usr/bin/env bash
# The accelerator checks, in one pass, on a GPU or a TPU: generation at real
# sizes (Tunix's Sampler against the cached generate, with a floor), the
# cached loop in 4 phases against 1 (generation_phases), the compile time
# of its stage programs in turn and in threads (stage_compile), rows in lockstep
# (generation_lockstep), the Pallas cache read (generation_ragged, and alone
# against XLA's attention: cache_kernel), the fused greedy head (alone:
# head_kernel; in generate: generation_fused_head), the 4 phases as one
# program against the stages (generation_one_program), its per-op
# profile at batch 128, the SFT step at a real size (Splash on a
# TPU; SFT_STEP_ARGS overrides its shape), the two-stream step at
# 4 x 4096 and at 4 x 2048 as 4 accumulated calls of 1 row, the notebooks' code (benchmarks/notebooks.py), then the
# rollout, attention, SFT-step and DiffusionGemma-sampler benchmarks, then
# (given a finished `benchmarks/convert_code.py --out RUN`) the converted
# models re-timed against their AR peer by `benchmarks/convert_speed.py`.
#
#   bash tools/accelerator_bench.sh [RUN [STAGES]]   # logs under $OUT (or accel_out)
#   STEPS="generation sft_step" bash tools/accelerator_bench.sh   # some only
#   GENERATION_ARGS="--batch 32 --schedules b4s1" bash tools/accelerator_bench.sh
#
# Each step has its own time limit, so one that fails or hangs still leaves
# the others' figures (and `benchmarks/generation.py` prints each row as it
# is measured). Run from the repository root with the package importable
# (`pip install -e .`, PYTHONPATH, or on the lent TPU `source .tpu/env.sh`).
set -u
out=${OUT:-accel_out}
run=${1:-}
stages=${2:-sft,sft_kd_certainty}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.total \
      --format=csv 2>&1
  fi
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
all="generation generation_phases stage_compile generation_lockstep generation_ragged cache_kernel generation_fused_head generation_one_program head_kernel profile_generation sft_step_real sft_step_long sft_step_micro diffusion_gemma_real notebooks rollout attention sft_step diffusion_gemma_sampler"
steps=" ${STEPS:-$all} "
for name in $all; do
  [[ $steps == *" $name "* ]] || continue
  if [[ $name == generation ]]; then
    # shellcheck disable=SC2086  # GENERATION_ARGS is a list of flags
    step generation "${GENERATION_LIMIT:-600}" python3 benchmarks/generation.py \
      --model qwen3_0p6b --dtype bfloat16 \
      ${GENERATION_ARGS:---batch 1,32,128} --json "$out/generation.json"
  elif [[ $name == generation_phases ]]; then
    # The cached driver's loop in 4 phases against 1 (generate(cache_phases=)).
    step generation_phases 420 python3 benchmarks/generation.py \
      --model qwen3_0p6b --dtype bfloat16 --batch 128,32 --schedules b4s1 \
      --cache-phases 1,4 --raw-calls 0 --repeats 2 \
      --json "$out/generation_phases.json"
  elif [[ $name == stage_compile ]]; then
    # The 4-phase loop's stage programs compiled in turn and in threads.
    step stage_compile 300 python3 benchmarks/stage_compile.py \
      --model qwen3_0p6b --layers 7 --dtype bfloat16 --batch 32 \
      --cache-phases 4
  elif [[ $name == generation_lockstep ]]; then
    # Rows kept in phase at block 16 / 4 steps (generate(lockstep=)).
    step generation_lockstep 480 python3 benchmarks/generation.py \
      --model qwen3_0p6b --dtype bfloat16 --batch 32 --schedules b16s4 \
      --cache-phases 4 --lockstep 0,1 --raw-calls 0 --repeats 2 \
      --json "$out/generation_lockstep.json"
  elif [[ $name == generation_ragged ]]; then
    # The Pallas cache read of the slots in use (generate(ragged_cache=)).
    step generation_ragged 480 python3 benchmarks/generation.py \
      --model qwen3_0p6b --dtype bfloat16 --batch 128 --schedules b4s1 \
      --cache-phases 4 --ragged-cache 0,1 --raw-calls 0 --repeats 2 \
      --json "$out/generation_ragged.json"
  elif [[ $name == cache_kernel ]]; then
    # The Pallas cache read alone against XLA's, at Qwen3-0.6B's shapes.
    step cache_kernel 300 python3 benchmarks/cache_kernel.py \
      --slots 336 --chunks auto,48 --row-blocks 8 \
      --json "$out/cache_kernel.json"
  elif [[ $name == generation_fused_head ]]; then
    # Greedy proposals without the logits (generate(fused_head=)), lockstep.
    step generation_fused_head 540 python3 benchmarks/generation.py \
      --model qwen3_0p6b --dtype bfloat16 --batch 32 --schedules b16s4 \
      --cache-phases 4 --lockstep 1 --fused-head 0,1 --raw-calls 0 \
      --repeats 2 --json "$out/generation_fused_head.json"
  elif [[ $name == generation_one_program ]]; then
    # The 4 phases' stages in one program against one each
    # (generate(one_program=)); the first compiles for about 225 s.
    step generation_one_program 600 python3 benchmarks/generation.py \
      --model qwen3_0p6b --dtype bfloat16 --batch 32 --schedules b16s4 \
      --cache-phases 4 --lockstep 1 --fused-head 1 --one-program 0,1 \
      --raw-calls 0 --repeats 5 --json "$out/generation_one_program.json"
  elif [[ $name == head_kernel ]]; then
    # The fused head alone against XLA's head and passes (Qwen3-0.6B's).
    step head_kernel 240 python3 benchmarks/head_kernel.py \
      --json "$out/head_kernel.json"
  elif [[ $name == profile_generation ]]; then
    step profile_generation 240 python3 benchmarks/profile_generation.py \
      --model qwen3_0p6b --dtype bfloat16 --batch 128 --schedule b4s1 \
      --json "$out/profile_generation.json"
  elif [[ $name == sft_step_real ]]; then
    # shellcheck disable=SC2086  # SFT_STEP_ARGS is a list of flags
    step sft_step_real 600 python3 benchmarks/sft_step.py \
      --model qwen3_0p6b --dtype bfloat16 --attention auto \
      --sequential ${SFT_STEP_ARGS:---length 2048 --batch 4 --rounds 3 --head-chunk 1024 --streams single,two_stream}
  elif [[ $name == sft_step_long ]]; then
    # The two-stream step at 4 x 4096 (issue 36: fits at batch 4?).
    step sft_step_long 300 python3 benchmarks/sft_step.py \
      --model qwen3_0p6b --dtype bfloat16 --attention auto --sequential \
      --length 4096 --batch 4 --rounds 2 --head-chunk 1024 --remat decoder \
      --streams two_stream --no-causal
  elif [[ $name == sft_step_micro ]]; then
    # Batch 4 x 2048 as 4 accumulated calls of 1 row (no remat; issue 36).
    step sft_step_micro 600 python3 benchmarks/sft_step.py \
      --model qwen3_0p6b --dtype bfloat16 --attention auto --sequential \
      --length 2048 --batch 4 --micro-batch 1 --rounds 3 --head-chunk 1024 \
      --streams two_stream
  elif [[ $name == notebooks ]]; then
    # The three notebooks' code, each in one process (no Jupyter kernel:
    # the TPU refuses TCP), their default configuration: wall times.
    step notebooks 600 python3 benchmarks/notebooks.py \
      --json "$out/notebooks.json"
  elif [[ $name == diffusion_gemma_real ]]; then
    # DiffusionGemma-26B-A4B's layer widths at 2 layers: LoRA step + sampler.
    step diffusion_gemma_real 600 python3 benchmarks/diffusion_gemma_step.py \
      --size 26b_a4b_2layers --dtype bfloat16 --batch 2 --seq-len 1024 \
      --json "$out/diffusion_gemma_real.json"
  else
    step "$name" 150 python3 "benchmarks/$name.py"
  fi
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
