#!/usr/bin/env bash
# Measurements that need one real GPU: the GEMM calibration profile (whole and chunked GEMMs, at
# the unsharded and tensor=8 per-device projection shapes) and single-GPU train-step throughput
# and MFU, with the planner's datasheet prediction beside each measured step and the measured
# time of each op category beside its roofline price (bench.py --op-times).
#   bash benchmarks/gpu_single.sh OUT_DIR [PART...]
# PARTs (default all but ab and profile_small): profile profile_t8 gpt2_full gpt2_save_proj
# gpt2_none llama_l8 llama_l8_none ab profile_small.
# `profile_small` measures the memory passes at the sizes of one micro-batch's norms and biases
# (1-64 MiB) and the GEMMs at 2048 rows (a micro-batch of 2 x 1024): the per-pass overhead that
# the non-GEMM kernels of small micro-batches pay (2.8-5.4 us a norm or bias launch, fitted to
# GPT-2 1.5B's steps at M=1 and M=4 on one H200; benchmarks/results/README.md).
# `ab` times this tree against BASE_TREE side by side (benchmarks/gpu_ab.sh: GPT-2 1.5B with full
# remat and without, the 8-layer Llama-2 7B shape): the single-GPU efficiency table. Make the base
# tree here and carry it, e.g. for the program before the non-GEMM work (commit 4a68fba):
#   mkdir .base && git archive 4a68fba | tar -x -C .base && echo /.base/ >> .git/info/exclude
#   BASE_TREE=.base bash benchmarks/gpu_single.sh OUT ab        (device run: carry .base)
# The full 32-layer Llama-2 7B does not fit one GPU with fp32 AdamW state (16 B per parameter,
# 108 GB before activations), so its rows use 8 layers.
# Runs from the repository root with the machine's own jax (gpu_common.sh installs the checkout).
# Each step is independent: one that fails is logged and the rest still run.
set -u
out=${1:?usage: bash benchmarks/gpu_single.sh OUT_DIR [PART...]}
shift
parts=" ${*:-profile profile_t8 gpt2_full gpt2_save_proj gpt2_none llama_l8 llama_l8_none} "
dest=$out
source "$(dirname "$0")/gpu_common.sh"
log_env env.txt

want profile && step "profile_${tag}-1_gpt2-1.5b" python3 scripts/calibrate.py --model gpt2-1.5b --tokens 8192 \
  --square-sizes 1024,2048,4096,8192 --dtypes bfloat16,float32 --memory-sizes 16M,64M,256M,1G \
  --out "$out/profile_${tag}-1_gpt2-1.5b.json"
want profile_t8 && step "profile_${tag}-1_gpt2-1.5b_t8" python3 scripts/calibrate.py --model gpt2-1.5b --tokens 8192 \
  --tensor 8 --square-sizes 1024 --dtypes bfloat16,float32 --memory-sizes 16M,256M \
  --out "$out/profile_${tag}-1_gpt2-1.5b_t8.json"
want profile_small && step "profile_${tag}-1_small" python3 scripts/calibrate.py --model gpt2-1.5b \
  --tokens 2048 --square-sizes 1024 --dtypes bfloat16 --memory-sizes 1M,2M,4M,8M,16M,64M \
  --out "$out/profile_${tag}-1_small.json"
for remat in full save_proj none; do
  want "gpt2_$remat" && step "bench_gpt2-1.5b_${tag}x1_${remat}" python3 scripts/bench.py --model gpt2-1.5b \
    --dtype bfloat16 --remat "$remat" --batch-size 8 --seq-len 1024 --rounds 5 --warmup 2 \
    --variant megatron:data=1/tp/megatron --variant oases-k2:data=1/tp/oases \
    --predict datasheet --op-times 3 --json "$out/bench_gpt2-1.5b_${tag}x1_${remat}.json"
done
for remat in full none; do
  part=llama_l8$([[ $remat == none ]] && echo _none)
  want "$part" && step "bench_llama2-7b-l8_${tag}x1_${remat}" python3 scripts/bench.py \
    --model llama2-7b --model-set n_layers=8 --dtype bfloat16 --remat "$remat" --batch-size 8 \
    --seq-len 1024 --rounds 5 --warmup 2 --variant megatron:data=1/tp/megatron \
    --variant oases-k2:data=1/tp/oases --predict datasheet --op-times 3 \
    --json "$out/bench_llama2-7b-l8_${tag}x1_${remat}.json"
done
if want ab; then
  base=${BASE_TREE:?the ab part needs BASE_TREE, a source tree of the baseline commit}
  step "ab_${tag}x1" bash benchmarks/gpu_ab.sh "$out/ab" . "$base"
fi
