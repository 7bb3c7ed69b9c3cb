# Sourced by the single-GPU scripts (gpu_single.sh, gpu_pipeline.sh), after they set `out` (the
# log's directory), `dest` (where each step's stdout goes) and `parts` (" PART PART "): the
# environment they run under, `want PART`, `step NAME CMD...`, `$tag` (the GPU's name, e.g.
# h100) and the machine's versions in `$out/$1`.
# The checkout's folders install as one `oases_jax` namespace (pyproject.toml), so the tree itself
# is not importable: install it, without dependencies (the machine's own jax), into .gl/site,
# from a wheel carried in .whl/ (`pip wheel --no-deps -w .whl .` before the lease) or else built
# here.
site=.gl/site
if [[ ! -d $site/oases_jax ]]; then
  wheel=$(ls .whl/oases_jax-*.whl 2>/dev/null | head -1)
  python3 -m pip install -q --no-deps --target "$site" ${wheel:-"--no-build-isolation" .}
fi
export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
export XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
mkdir -p "$out" "$dest"
tag=$(python3 -c "import jax; print(jax.devices()[0].device_kind.split()[1].lower())")

want() { [[ $parts == *" $1 "* ]]; }

step() {  # step NAME CMD...: run CMD, keep its stdout in $dest/NAME.txt, its stderr in the log
  echo "== $1: ${*:2}" | tee -a "$out/log.txt"
  local t0=$SECONDS
  "${@:2}" > "$dest/$1.txt" 2>> "$out/log.txt" || echo "!! $1 failed (rc $?)" | tee -a "$out/log.txt"
  echo "== $1 took $((SECONDS - t0)) s" | tee -a "$out/log.txt"
}

log_env() {  # log_env FILE: the GPUs and the versions, into $out/FILE
  { nvidia-smi -L; python3 -c "import jax, flax, optax; print('jax', jax.__version__, 'flax',
    flax.__version__, 'optax', optax.__version__, jax.devices())"; } | tee -a "$out/$1"
}
