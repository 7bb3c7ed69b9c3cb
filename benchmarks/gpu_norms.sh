#!/usr/bin/env bash
# One H100: train-step time of bf16 models with norms and activations that recompute their
# float32 internals in the backward (this tree) against the same tree with the layers module of
# the commit before (norms left to autodiff), no remat and save_proj.
#   git show bf44373:models/layers.py > old_layers.py   # the commit before
#   bash benchmarks/gpu_norms.sh OUT_DIR old_layers.py
set -u
out=${1:?usage: bash benchmarks/gpu_norms.sh OUT_DIR OLD_LAYERS_PY}
old=${2:?the previous models/layers.py}
mkdir -p "$out"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
cp models/layers.py "$out/new_layers.py"
for version in new old; do
  [[ $version == old ]] && cp "$old" models/layers.py
  for remat in none save_proj; do
    python3 scripts/bench.py --model gpt2-1.5b --dtype bfloat16 --remat "$remat" --batch-size 8 \
      --seq-len 1024 --rounds 5 --warmup 2 --variant "megatron:data=1/tp/megatron" \
      --json "$out/norms_gpt2-1.5b_${remat}_${version}.json" > "$out/norms_gpt2-1.5b_${remat}_${version}.txt" 2>> "$out/log.txt" \
      || echo "gpt2 $remat $version failed" >> "$out/log.txt"
  done
  python3 scripts/bench.py --model llama2-7b --model-set n_layers=8 --dtype bfloat16 --remat none \
    --batch-size 8 --seq-len 1024 --rounds 5 --warmup 2 --variant "megatron:data=1/tp/megatron" \
    --json "$out/norms_llama2-7b-l8_none_${version}.json" > "$out/norms_llama2-7b-l8_none_${version}.txt" 2>> "$out/log.txt" \
    || echo "llama none $version failed" >> "$out/log.txt"
done
cp "$out/new_layers.py" models/layers.py
