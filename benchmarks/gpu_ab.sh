#!/usr/bin/env bash
# One GPU: train-step time of two source trees side by side, the same models and flags, each
# tree in its own processes (alternating, so drift hits both): e.g. a commit and the one before.
#   mkdir -p ab/new ab/old
#   git archive HEAD | tar -x -C ab/new; git archive HEAD~1 | tar -x -C ab/old
#   bash benchmarks/gpu_ab.sh OUT_DIR ab/new ab/old
# Writes OUT_DIR/ab_<model>_<remat>_<tree>.{json,txt}: bench.py's reports (median step time,
# tokens/s, MFU).
set -u
out=${1:?usage: bash benchmarks/gpu_ab.sh OUT_DIR NEW_TREE OLD_TREE}
new=${2:?the new source tree}
old=${3:?the old source tree}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=${JAX_PLATFORMS:-cuda} XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
site_of() {  # the PYTHONPATH a tree runs under: the tree itself (before its folders installed as one
  # `oases_jax` namespace) or its own install, without dependencies, in TREE/.gl/site
  if grep -q "package-dir" "$1/pyproject.toml"; then
    [[ -d $1/.gl/site/oases_jax ]] \
      || python3 -m pip install -q --no-deps --no-build-isolation --target "$1/.gl/site" "$1"
    echo "$(cd "$1" && pwd)/.gl/site"
  else
    cd "$1" && pwd
  fi
}
run() {  # tree name model remat extra...
  local tree=$1 name=$2 model=$3 remat=$4; shift 4
  local site; site=$(site_of "$tree")
  (cd "$tree" && PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} python3 scripts/bench.py --model "$model" \
     --dtype bfloat16 --remat "$remat" --batch-size 8 --seq-len 1024 --rounds 5 --warmup 2 \
     --variant "megatron:data=1/tp/megatron" "$@" --json "$out/ab_${model}_${remat}_${name}.json" \
     > "$out/ab_${model}_${remat}_${name}.txt" 2>> "$out/log.txt") \
     || echo "$model $remat $name failed" >> "$out/log.txt"
}
for remat in full none; do
  for tree in new old; do
    run "$( [[ $tree == new ]] && echo "$new" || echo "$old")" "$tree" gpt2-1.5b "$remat"
  done
done
for tree in new old; do
  run "$( [[ $tree == new ]] && echo "$new" || echo "$old")" "$tree" llama2-7b none \
    --model-set n_layers=8
done
