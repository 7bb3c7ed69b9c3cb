#!/usr/bin/env bash
# One device lease's measurements in one call: the named parts of gpu_single.sh and
# gpu_pipeline.sh, in the order given, each part's files packed into OUT/results.tgz as soon as it
# ends, so a call stopped at its time limit still returns every part that finished (the device
# tool returns at most 8 files from OUT).
#   bash benchmarks/gpu_lease.sh OUT single:gpt2_full pipeline:full_m4 single:profile ...
# The GPU image has no pydantic: carry its wheels in .whl/ and put them on PYTHONPATH first
# (benchmarks/results/README.md, "Measured on one GPU").
set -u
out=${1:?usage: bash benchmarks/gpu_lease.sh OUT_DIR SCRIPT:PART...}
shift
here=$(dirname "$0")
mkdir -p "$out/work"
for item in "$@"; do
  script=${item%%:*} part=${item#*:}
  case $script in
    single) bash "$here/gpu_single.sh" "$out/work/single" "$part" ;;
    pipeline) bash "$here/gpu_pipeline.sh" "$out/work/pipeline_$part" "$part" ;;
    *) echo "gpu_lease.sh: unknown script '$script' in '$item': use single:PART or pipeline:PART" >&2
       exit 2 ;;
  esac
  tar -czf "$out/results.tgz.part" -C "$out/work" . && mv "$out/results.tgz.part" "$out/results.tgz"
  cat "$out"/work/*/log.txt "$out"/work/single/env.txt 2>/dev/null > "$out/log.txt"
done
