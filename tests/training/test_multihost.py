"""Two processes of 4 CPU devices on localhost form one 8-device mesh and train like one process;
a lost process or one whose peers never arrive ends the run in one line."""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from oases_jax.models import get_preset
from oases_jax.training import TrainConfig, train
from oases_jax.training.checkpoint import Checkpointer

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


def run_processes(cmds: list[list[str]], where: pathlib.Path, *, env: dict, cwd,
                  timeout: float = 300) -> list[tuple[int, str, str]]:
    """Start one process per command at once and wait for all: (return code, stdout, stderr)
    of each. Output goes to files under `where`, not pipes (a full pipe could deadlock); a
    process still running at the timeout is killed."""
    logs = [(where / f"out{i}.txt", where / f"err{i}.txt") for i in range(len(cmds))]
    procs = []
    for cmd, (stdout, stderr) in zip(cmds, logs, strict=True):
        with stdout.open("w") as o, stderr.open("w") as e:
            procs.append(subprocess.Popen(cmd, stdout=o, stderr=e, env=env, cwd=cwd))
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, o.read_text(), e.read_text())
            for p, (o, e) in zip(procs, logs, strict=True)]


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
    done = run_processes([[sys.executable, str(ROOT / "scripts" / "train.py"), *args,
                           "--process-id", str(i)] for i in range(2)], tmp_path, env=cli_env(),
                         cwd=tmp_path)
    for code, _, stderr in done:
        assert code == 0, stderr[-3000:]
    assert f"steps 1..{STOP} (stop_after)" in done[0][1]

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


# --- faults: a lost process, peers that never arrive ----------------------------------------

_XLA_LOG = re.compile(r"^(WARNING: All log messages before absl|[IWE]\d{4} \d\d:\d\d)|^\[Gloo\]")
PEER_TIMEOUT = 10


def error_lines(stderr: str) -> list[str]:
    """stderr without the runtime's own informational log lines."""
    return [ln for ln in stderr.strip().splitlines() if ln.strip() and not _XLA_LOG.match(ln)]


def start(tmp_path, i: int, port: int, *args: str) -> subprocess.Popen:
    cmd = [sys.executable, str(ROOT / "scripts" / "train.py"), *args, "--cpu-devices", "4",
           "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
    with (tmp_path / f"out{i}.txt").open("w") as o, (tmp_path / f"err{i}.txt").open("w") as e:
        return subprocess.Popen(cmd, stdout=o, stderr=e, env=cli_env(), cwd=tmp_path)


@pytest.mark.slow
def test_a_lost_process_stops_the_others_in_one_line(tmp_path, jax_cache):
    """Process 1 is killed mid-run: process 0 exits 4 within --peer-timeout (plus the poll and
    the start-up slack), with one line naming process 1; the checkpoint directory holds only
    complete checkpoints (the unfinished save is removed)."""
    port, out = free_port(), tmp_path / "run"
    args = ("--model", "tiny", "--steps", "1000", "--batch-size", "8", "--seq-len", "32",
            "--mesh", "data=2,tensor=4", "--log-every", "1", "--eval-batches", "0",
            "--ckpt-every", "2", "--no-progress", "--out-dir", str(out),
            "--peer-timeout", str(PEER_TIMEOUT))
    procs = [start(tmp_path, i, port, *args) for i in range(2)]
    try:
        deadline = time.monotonic() + 300
        metrics = out / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
            assert time.monotonic() < deadline and procs[0].poll() is None, \
                (tmp_path / "err0.txt").read_text()[-3000:]
            time.sleep(0.2)
        procs[1].kill()
        killed = time.monotonic()
        code = procs[0].wait(timeout=PEER_TIMEOUT + 60)
        elapsed = time.monotonic() - killed
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    stderr = (tmp_path / "err0.txt").read_text()
    assert code == 4, stderr[-3000:]
    assert elapsed < PEER_TIMEOUT + 15, elapsed
    lines = error_lines(stderr)
    assert len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith(f"train.py: error: process 1 of 2 was lost (no heartbeat for "
                               f"{PEER_TIMEOUT} s, --peer-timeout); this process stops too")
    entries = sorted(p.name for p in (out / "ckpt").iterdir())
    assert entries and all(name.isdigit() for name in entries), entries
    reader = Checkpointer(str(out / "ckpt"), create=False)
    try:
        for name in entries:  # each complete: its metadata reads back
            assert reader.read_meta(int(name))["step"] == int(name)
    finally:
        reader.close()


def test_a_process_whose_peers_never_arrive_gives_up(tmp_path):
    t0 = time.monotonic()
    proc = start(tmp_path, 1, free_port(), "--model", "tiny", "--out-dir", str(tmp_path / "r"),
                 "--join-timeout", "3")
    code = proc.wait(timeout=120)
    stderr = (tmp_path / "err1.txt").read_text()
    assert code == 4, stderr[-3000:]
    assert time.monotonic() - t0 < 3 + 60  # start-up (imports) and the 3 s wait
    assert error_lines(stderr) == [
        f"train.py: error: process 1 waited 3 s for all 2 processes to join at "
        f"{proc.args[proc.args.index('--coordinator') + 1]} and gave up; start every process "
        "with the same --coordinator and --num-processes, or raise --join-timeout"]
    assert not (tmp_path / "r").exists()
