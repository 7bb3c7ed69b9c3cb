"""Force the CPU platform and 8 virtual devices before JAX starts."""

import os
import pathlib
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# The suite compiles hundreds of small CPU programs, and LLVM's optimisations are most of each
# compile: without them the suite runs in about half the time, while these tiny programs run
# barely slower. The GPU-target compiles the tests inspect come out the same (checked: identical
# overlap shares for every schedule). Subprocesses inherit the flags.
_FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FAST_COMPILE}".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
