"""Leftovers and contention: an interrupted save's directory is removed by the next run, a save
that cannot be written (a full disk) ends the run in one line with the previous checkpoint
intact and no partial files, and one output directory serves one live run at a time."""

import dataclasses
import json
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from oases_jax.errors import UserError
from oases_jax.models import get_preset
from oases_jax.training import CheckpointConfig, TrainConfig, train
from oases_jax.training.checkpoint import TMP_SUFFIX, Checkpointer, CheckpointWriteError
from oases_jax.training.runlock import RunLock, lock_path

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = ROOT / "scripts" / "train.py"
CLI = ("--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--log-every", "1",
       "--eval-batches", "0", "--no-progress")


def config(root: pathlib.Path, steps: int = 4, **kw) -> TrainConfig:
    return TrainConfig(model=get_preset("tiny"), steps=steps, batch_size=8, seq_len=32,
                       log_every=1, eval_batches=0, progress=False,
                       ckpt=CheckpointConfig(dir=str(root / "ckpt"), every=2),
                       metrics_out=str(root / "metrics.jsonl"), **kw)


def steps_in(ckpt: pathlib.Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


def cli_env() -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "SLURM"))}
    env.pop("XLA_FLAGS", None)
    return env | {"JAX_PLATFORMS": "cpu"}


def one_line(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


# --- leftovers of an interrupted save ----------------------------------------------------------


def _leftover(ckpt: pathlib.Path, step: int) -> pathlib.Path:
    """What a run killed inside the save of `step` leaves (see test_resume's SIGKILL test)."""
    tmp = ckpt / f"{step}{TMP_SUFFIX}" / f"state{TMP_SUFFIX}"
    tmp.mkdir(parents=True)
    (tmp / "partial").write_bytes(b"\0" * 1000)
    return tmp.parent


@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_next_run_removes_unfinished_saves(tmp_path, jax_cache, capsys, resume):
    if resume:
        train(config(tmp_path, stop_after=2))
    left = _leftover(tmp_path / "ckpt", 3)
    capsys.readouterr()
    cfg = config(tmp_path)
    train(dataclasses.replace(cfg, ckpt=dataclasses.replace(cfg.ckpt, resume=resume)))
    out = capsys.readouterr().out
    assert (f"checkpoint: removing 1 unfinished save(s) of an interrupted run from "
            f"{tmp_path / 'ckpt'}: {left.name}") in out
    assert steps_in(tmp_path / "ckpt") == ["2", "4"]


# --- a save that cannot be written --------------------------------------------------------------


def test_full_disk_during_a_save(tmp_path, jax_cache, monkeypatch):
    """The save of step 4 fails as writes fail on a full disk (here: past the file-size limit,
    EFBIG, so TensorStore's own writes fail): one line naming the step and the reason, step 2
    intact and readable, nothing partial left."""
    save = Checkpointer.save

    def save_on_a_full_disk(self, step, state, meta):
        if step == 4:
            self.manager.wait_until_finished()  # step 2 on disk; the disk fills in step 4's save
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # write() fails instead of killing
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        save(self, step, state, meta)

    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    monkeypatch.setattr(Checkpointer, "save", save_on_a_full_disk)
    try:
        with pytest.raises(CheckpointWriteError) as info:
            train(config(tmp_path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"checkpoint step 4 could not be written to {tmp_path / 'ckpt'} "
                              "(File too large); its partial files were removed and step 2 is "
                              "the latest checkpoint")
    assert steps_in(tmp_path / "ckpt") == ["2"]
    reader = Checkpointer(str(tmp_path / "ckpt"), create=False)
    try:
        assert reader.read_meta(2)["step"] == 2
    finally:
        reader.close()


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "-r", "-m", "sh", "-c", "mount -t tmpfs none /mnt"],
                           capture_output=True) if shutil.which("unshare") else None
    return probe is not None and probe.returncode == 0


@pytest.mark.slow
@pytest.mark.skipif(not _can_mount_tmpfs(), reason="no user namespaces to mount a tmpfs")
def test_full_tmpfs_during_a_save_is_one_line(tmp_path):
    """train.py with its output on a 2.5 MB tmpfs: the first checkpoint (1.6 MB) fits, the
    second does not. Exit 5, one line; the tmpfs then holds step 2 and the metrics only."""
    out = tmp_path / "out"
    out.mkdir()
    script = textwrap.dedent(f"""
        mount -t tmpfs -o size=2500k tmpfs {out} || exit 99
        {sys.executable} {TRAIN} {' '.join(CLI)} --steps 4 --ckpt-every 2 --out-dir {out} \\
            2> {tmp_path}/stderr.txt
        echo "rc=$?"
        ls -a {out}/ckpt
    """)
    proc = subprocess.run(["unshare", "-r", "-m", "sh", "-c", script], capture_output=True,
                          text=True, timeout=600, env=cli_env(), cwd=tmp_path)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert "rc=5" in proc.stdout, (proc.stdout, stderr[-3000:])
    line = one_line(stderr)
    assert line.startswith("train.py: error: checkpoint step 4 could not be written to ")
    assert "(No space left on device)" in line and "step 2 is the latest checkpoint" in line
    assert proc.stdout.split("rc=5")[1].split() == [".", "..", "2"]


def test_orbax_tasks_never_retrieved_are_dropped_before_the_failure_is_caught():
    """A failed write's sibling tasks can be collected on orbax's thread before the failure
    reaches the Checkpointer (the race behind a 67-line stderr on a full tmpfs): asyncio's
    "never retrieved" log of a task that failed inside orbax is dropped from the start; one
    that failed elsewhere is kept."""
    import logging

    from oases_jax.training import checkpoint

    def record(filename: str) -> logging.LogRecord:
        try:
            exec(compile("raise ValueError('No space left on device')", filename, "exec"), {})
        except ValueError as e:
            exc_info = type(e), e, e.__traceback__
        return logging.LogRecord("asyncio", logging.ERROR, "", 0,
                                 "Task exception was never retrieved\nfuture: <Task>", None,
                                 exc_info)

    (drop,) = [f for f in logging.getLogger("asyncio").filters
               if isinstance(f, checkpoint._OrbaxNeverRetrieved)]
    assert not drop.filter(record(os.path.join(os.sep, "venv", "orbax", "checkpoint", "s.py")))
    assert drop.filter(record(os.path.join(os.sep, "venv", "elsewhere", "module.py")))


# --- one live run per output directory ----------------------------------------------------------


def test_a_held_output_is_refused(tmp_path, jax_cache):
    cfg = config(tmp_path)
    with RunLock([cfg.ckpt.dir]):
        with pytest.raises(UserError, match=rf"{tmp_path / 'ckpt'} is in use by another run "
                           rf"\(pid {os.getpid()} on .*\); wait for it to end or pass another "
                           "--out-dir"):
            train(cfg)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "metrics.jsonl").exists()
    with RunLock([cfg.metrics_out]), pytest.raises(UserError, match=r"metrics\.jsonl is in use"):
        train(cfg)


def test_a_lock_left_by_a_dead_run_is_taken(tmp_path, jax_cache, capsys):
    cfg = config(tmp_path, steps=2)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from training.runlock import RunLock; "
         f"RunLock([{cfg.ckpt.dir!r}]).__enter__(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, cwd=ROOT, env=cli_env())
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.kill()  # SIGKILL: the lock file stays, naming the dead holder
        holder.wait()
    assert f"pid {holder.pid}" in lock_path(cfg.ckpt.dir).read_text()
    train(cfg)
    assert (f"note: took over the lock on {cfg.ckpt.dir} left by a run that ended without "
            f"releasing it (pid {holder.pid} on ") in capsys.readouterr().out
    assert lock_path(cfg.ckpt.dir).read_text() == ""  # released cleanly this time


@pytest.mark.slow
def test_two_runs_on_one_output_directory(tmp_path, jax_cache):
    """Two train.py runs (seeds 1 and 2) started together on one --out-dir: one trains, the
    other exits 2 with one line; the directory holds the winner's checkpoints and metrics."""
    out = tmp_path / "run"
    env = cli_env() | {"JAX_COMPILATION_CACHE_DIR": str(jax_cache)}
    procs = [subprocess.Popen(
        [sys.executable, str(TRAIN), *CLI, "--steps", "6", "--ckpt-every", "2",
         "--seed", str(seed), "--out-dir", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        for seed in (1, 2)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    codes = sorted(code for code, _, _ in results)
    assert codes == [0, 2], [(c, e[-2000:]) for c, _, e in results]
    winner = next(i for i, (code, _, _) in enumerate(results) if code == 0)
    line = one_line(results[1 - winner][2])
    assert line.startswith("train.py: error: ") and str(out) in line
    assert "in use by another run" in line or "already holds checkpoints" in line
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    summary = results[winner][1].strip().splitlines()[-2]  # "steps 1..6 (done): loss A -> B"
    first, last = (f"{r['loss']:.4f}" for r in (records[0], records[-1]))
    assert f"loss {first} -> {last}" in summary
    assert steps_in(out / "ckpt") == ["2", "4", "6"]
    reader = Checkpointer(str(out / "ckpt"), create=False)
    try:
        assert reader.read_meta(6)["seed"] == winner + 1
    finally:
        reader.close()
