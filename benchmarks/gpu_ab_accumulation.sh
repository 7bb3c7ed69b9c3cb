#!/usr/bin/env bash
# One GPU: accumulated train steps (M=4 micro-batches) of two source trees side by side, in
# alternating processes, GPT-2 1.5B (full remat) twice around Llama-2 7B's 8-layer shape (no
# remat). Made for the cast-once accumulation (60486f6) against the tree before it (2cb059c):
#   mkdir .base && git archive 2cb059c | tar -x -C .base    (device run: carry .base, and the
#   pydantic wheels as benchmarks/gpu_pipeline.sh says)
#   bash benchmarks/gpu_ab_accumulation.sh OUT_DIR [BASE_TREE]     (default .base)
set -u
out=${1:?usage: bash benchmarks/gpu_ab_accumulation.sh OUT_DIR [BASE_TREE]}
base=${2:-.base}
mkdir -p "$out"; out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
run() {  # tree name model remat extra...
  local tree=$1 name=$2 model=$3 remat=$4; shift 4
  (cd $tree && PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} python3 scripts/bench.py --model $model --dtype bfloat16 --remat $remat \
     --batch-size 8 --seq-len 1024 --rounds 5 --warmup 2 --microbatches 4 --variant m4:data=1/tp/megatron "$@" \
     --json $out/ab_m4_${model}_${remat}_${name}.json > $out/ab_m4_${model}_${remat}_${name}.txt 2>> $out/log.txt) || echo "$model $name failed" | tee -a $out/log.txt
  grep -A3 "^variant" $out/ab_m4_${model}_${remat}_${name}.txt | tail -1 | sed "s/^/$name $model $remat: /"
}
for tree in new old; do run $( [[ $tree == new ]] && echo . || echo "$base" ) $tree gpt2-1.5b full; done
for tree in new old; do run $( [[ $tree == new ]] && echo . || echo "$base" ) $tree llama2-7b none --model-set n_layers=8; done
for tree in new old; do run $( [[ $tree == new ]] && echo . || echo "$base" ) $tree gpt2-1.5b full; done
