#!/usr/bin/env bash
# The pipeline's tick loop on one real GPU: a one-stage pipeline (`--mesh data=1,stage=1`) runs
# the same executor, residual pools and stage program as a multi-stage one, minus the transfers,
# so its step against plain gradient accumulation over the same micro-batches (the `acc` row) is
# the executor's own cost on the hardware: storing and loading the residuals, the tick's switch,
# the per-step weight cast. These are the figures the planner's RESIDUAL_STORE/LOAD passes price.
# The `accum` part times plain accumulation alone at M = 1, 2, 4 and keeps each run's profiler
# trace, to be attributed here against a deviceless compile of the same program:
#   inspect_hlo.py --model gpt2-1.5b --dtype bfloat16 --remat full --target h100:1 --mesh data=1
#     --batch-size 8 --seq-len 1024 --microbatches M --op-trace runs/trace_mM --op-trace-steps 2
#   bash benchmarks/gpu_pipeline.sh OUT_DIR [PART...]
# PARTs (default all but merak_m4): full_m4 full_m8 none_m4 llama_m4 accum merak_m4 (Merak's
# schedule beside 1F1B, with the planner's datasheet prediction of each)
# Writes OUT_DIR/log.txt and OUT_DIR/pipeline_gpu.tgz (each run's table and JSON; the device
# tool returns at most 8 files). Runs from the repository root with the machine's own jax.
# The GPU image has no pydantic: carry its wheels (pydantic, pydantic_core, annotated_types,
# typing_inspection, typing_extensions in .whl/) and put them on PYTHONPATH before this runs.
set -u
out=${1:?usage: bash benchmarks/gpu_pipeline.sh OUT_DIR [PART...]}
shift
parts=" ${*:-full_m4 full_m8 none_m4 llama_m4 accum} "
dest=$out/runs
source "$(dirname "$0")/gpu_common.sh"
log_env log.txt

run() {  # run NAME BENCH-FLAGS...: one bench.py run, its table and JSON kept
  step "$1" python3 scripts/bench.py "${@:2}" --json "$dest/$1.json"
}

common=(--dtype bfloat16 --batch-size 8 --seq-len 1024 --rounds 5 --warmup 2
        --mesh data=1,stage=1 --variant acc:data=1/tp/megatron)
# bench.py holds every variant's train state at once (GPT-2 1.5B: 18 GB of fp32 weights and AdamW
# moments each), so a run pairs the accumulation baseline with at most two pipelined variants.
want full_m4 && run "pipeline_gpt2-1.5b_${tag}x1_full_m4" --model gpt2-1.5b --remat full --microbatches 4 \
  --pipeline gpipe,1f1b --op-times 2 "${common[@]}"
want full_m8 && run "pipeline_gpt2-1.5b_${tag}x1_full_m8" --model gpt2-1.5b --remat full --microbatches 8 \
  --pipeline gpipe,1f1b "${common[@]}"
want none_m4 && run "pipeline_gpt2-1.5b_${tag}x1_none_m4" --model gpt2-1.5b --remat none --microbatches 4 \
  --pipeline 1f1b "${common[@]}"
want merak_m4 && run "pipeline_gpt2-1.5b_${tag}x1_merak_m4" --model gpt2-1.5b --remat full --microbatches 4 \
  --pipeline 1f1b,merak --predict datasheet "${common[@]}"
want llama_m4 && run "pipeline_llama2-7b-l8_${tag}x1_none_m4" --model llama2-7b --model-set n_layers=8 \
  --remat none --microbatches 4 --pipeline 1f1b "${common[@]}"
if want accum; then
  for m in 1 2 4; do
    run "accumulation_gpt2-1.5b_${tag}x1_m$m" --model gpt2-1.5b --dtype bfloat16 --remat full \
      --batch-size 8 --seq-len 1024 --rounds 3 --warmup 2 --microbatches $m \
      --variant m$m:data=1/tp/megatron --op-times 2 --trace-dir "$out/runs/trace_m$m"
  done
  find "$out/runs" -name '*.xplane.pb' -delete  # the Perfetto trace is what is read back
fi
tar -czf "$out/pipeline_gpu.tgz" -C "$out" runs && rm -r "$out/runs"
