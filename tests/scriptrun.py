"""Run a script of scripts/ in a subprocess on the CPU, the way a user runs it."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_script(name: str, *args: str, timeout: float = 300, cwd=None):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the script sets its own device count
    return subprocess.run([sys.executable, str(ROOT / "scripts" / name), *args],
                          capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=cwd or ROOT)
