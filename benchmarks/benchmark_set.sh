#!/usr/bin/env bash
# The planner's benchmark set of real workloads (docs/planner.md, "The benchmark set"): each one
# planned and verified (--verify 5: the top 5 plans and the best FSDP-only plan compiled
# deviceless through the one compile path), its output and plan JSON written to OUT_DIR.
#   bash benchmarks/benchmark_set.sh OUT_DIR [NAME...]
# NAMEs (default all): llama2-7b_h100-8 gpt2-1.5b_h100-8 oases-h4096-l16_3090-pcie-32
# oases-h4096-l16_3090-nvlink-32 oases-h2048-l24_3090-pcie-32 oases-h2048-l24_3090-nvlink-32
# llama2-70b_h100-32 gpt-20b_h100-32. CPU only, no GPU: minutes per workload on 2 cores.
set -u
out=${1:?usage: bash benchmarks/benchmark_set.sh OUT_DIR [NAME...]}
shift
mkdir -p "$out"
export JAX_PLATFORMS=cpu PYTHONUNBUFFERED=1
PY=${PY:-python}
declare -A ARGS=(
  [llama2-7b_h100-8]="--model llama2-7b --model-set dtype=bfloat16 --cluster h100-8 --global-batch 8 --seq-len 2048"
  [gpt2-1.5b_h100-8]="--model gpt2-1.5b --model-set n_heads=20 --model-set head_dim=80 --model-set dtype=bfloat16 --cluster h100-8 --global-batch 16 --seq-len 1024"
  [oases-h4096-l16_3090-pcie-32]="--model oases-h4096-l16 --cluster 3090-pcie-32 --global-batch 32 --seq-len 1024"
  [oases-h4096-l16_3090-nvlink-32]="--model oases-h4096-l16 --cluster 3090-nvlink-32 --global-batch 32 --seq-len 1024"
  [oases-h2048-l24_3090-pcie-32]="--model oases-h2048-l24 --cluster 3090-pcie-32 --global-batch 32 --seq-len 1024"
  [oases-h2048-l24_3090-nvlink-32]="--model oases-h2048-l24 --cluster 3090-nvlink-32 --global-batch 32 --seq-len 1024"
  [llama2-70b_h100-32]="--model llama2-70b --model-set dtype=bfloat16 --cluster h100-32 --global-batch 32 --seq-len 2048"
  [gpt-20b_h100-32]="--model gpt-20b --model-set dtype=bfloat16 --cluster h100-32 --global-batch 32 --seq-len 1024"
)
ORDER="llama2-7b_h100-8 gpt2-1.5b_h100-8 oases-h4096-l16_3090-pcie-32 oases-h4096-l16_3090-nvlink-32
oases-h2048-l24_3090-pcie-32 oases-h2048-l24_3090-nvlink-32 llama2-70b_h100-32 gpt-20b_h100-32"
names=${*:-$ORDER}
for name in $names; do
  args=${ARGS[$name]:-}
  if [[ -z $args ]]; then echo "benchmark_set.sh: unknown workload $name; one of: $ORDER" >&2; exit 2; fi
  cmd="$PY scripts/plan.py $args --verify 5 --top 8 --json $out/plan_$name.json"
  echo "== $name: $cmd"
  { echo "# $cmd"; t0=$SECONDS; $cmd 2>&1 | grep -v -E "^(W[0-9]{4}|WARNING|  *warnings.warn)"
    echo "# $((SECONDS - t0)) s"; } > "$out/plan_$name.txt"
  tail -n 4 "$out/plan_$name.txt"
done
