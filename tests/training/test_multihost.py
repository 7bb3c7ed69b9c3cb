"""Two processes of 4 CPU devices on localhost form one 8-device mesh and train like one process."""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from models import get_preset
from training import TrainConfig, train
from training.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Set by the test process or a cluster; a training subprocess must not inherit them.
INHERIT_NOT = {
    *("JAX_NUM_CPU_DEVICES", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
    *("JAX_LOCAL_DEVICE_IDS", "JAX_COMPILATION_CACHE_DIR", "OMPI_COMM_WORLD_SIZE"),
}
STEPS, STOP = 8, 5  # the schedule of an 8-step run, stopped after 5 (as in test_resume)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict:
    """CPU only, and nothing inherited that sets a device count or joins a cluster."""
    env = {k: v for k, v in os.environ.items() if k not in INHERIT_NOT and k[:5] != "SLURM"}
    flags = env.pop("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "host_platform_device_count" not in f)
    env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.mark.slow
def test_two_processes_train_like_one(tmp_path, jax_cache):
    port, out = free_port(), tmp_path / "run"
    args = (
        *("--model", "tiny", "--steps", str(STEPS), "--stop-after", str(STOP)),
        *("--batch-size", "8", "--seq-len", "32", "--mesh", "data=2,tensor=4"),
        *("--log-every", "1", "--eval-batches", "0", "--no-progress", "--out-dir", str(out)),
        *("--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"),
    )
    logs = [(tmp_path / f"out{i}.txt", tmp_path / f"err{i}.txt") for i in range(2)]
    procs = []
    for i, (stdout, stderr) in enumerate(logs):  # files, not pipes: a full pipe could deadlock
        with stdout.open("w") as o, stderr.open("w") as e:
            cmd = [
                sys.executable,
                str(ROOT / "scripts" / "train.py"),
                *args,
                "--process-id",
                str(i),
            ]
            procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, env=cli_env(), cwd=tmp_path))
    try:
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outputs = [(o.read_text(), e.read_text()) for o, e in logs]
    for p, (_, stderr) in zip(procs, outputs, strict=True):
        assert p.returncode == 0, stderr[-3000:]
    assert f"steps 1..{STOP} (stop_after)" in outputs[0][0]

    reference = train(
        TrainConfig(
            model=get_preset("tiny"),
            steps=STEPS,
            stop_after=STOP,
            batch_size=8,
            seq_len=32,
            log_every=1,
            eval_batches=0,
            progress=False,
        )
    ).losses
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == sorted(reference) == list(range(1, STOP + 1))
    np.testing.assert_allclose(
        [losses[s] for s in reference], list(reference.values()), rtol=1e-5, atol=0
    )
    # Both processes wrote their shards of one checkpoint.
    ckpt = Checkpointer(str(out / "ckpt"), create=False)
    try:
        assert ckpt.latest_step() == STOP
    finally:
        ckpt.close()
