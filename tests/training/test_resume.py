"""Resuming is exact, checkpoints survive a crash mid-save, and the CLI refuses what loses data.

Every run here (in-process and scripts/train.py subprocesses) shares one persistent compilation
cache: compiling the tiny model, not training it, is most of a run's time on CPU.
"""

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import types

import jax
import numpy as np
import pytest

from oases_jax.models import get_preset
from oases_jax.training import CheckpointConfig, TrainConfig, train
from oases_jax.training.checkpoint import Checkpointer

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Set by the test process or a cluster; a training subprocess must not inherit them.
INHERIT_NOT = {
    *("JAX_NUM_CPU_DEVICES", "JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
    *("JAX_LOCAL_DEVICE_IDS", "JAX_COMPILATION_CACHE_DIR", "OMPI_COMM_WORLD_SIZE"),
}
TRAIN = ROOT / "scripts" / "train.py"
STEPS, STOP = 8, 4  # in-process: 8 uninterrupted steps vs 4, then resume
KILL, TERM = 3, 5  # CLI: SIGKILL inside the save of step 3, then SIGTERM at step 5
CLI = (
    *("--model", "tiny", "--steps", str(STEPS), "--batch-size", "8", "--seq-len", "32"),
    *("--log-every", "1", "--eval-batches", "0", "--ckpt-every", "1", "--no-progress"),
)

# scripts/train.py with faults injected, chosen by environment variables (`python -c`).
FAULTS = textwrap.dedent(
    """
    import os, runpy, signal, sys

    if "FAULT_KILL_IN_SAVE" in os.environ:
        # SIGKILL once the arrays of step K are on disk in orbax's temporary directory, before
        # orbax writes the item metadata and renames the directory (the commit).
        tmp = "/" + os.environ["FAULT_KILL_IN_SAVE"] + ".orbax-checkpoint-tmp/"
        try:
            from orbax.checkpoint._src.serialization import jax_array_handlers as h

            write = h._async_serialize_replica_slices
        except (ImportError, AttributeError):  # another orbax: die at the first commit rename
            rename = os.rename

            def rename_or_die(src, dst, *args, **kwargs):
                if tmp in f"{src}/":
                    os.kill(os.getpid(), signal.SIGKILL)
                return rename(src, dst, *args, **kwargs)

            os.rename = rename_or_die
        else:

            async def write_then_die(values, infos, *args, **kwargs):
                out = await write(values, infos, *args, **kwargs)
                if any(tmp in f"{info.parent_dir}/" for info in infos):
                    os.kill(os.getpid(), signal.SIGKILL)
                return out

            h._async_serialize_replica_slices = write_then_die

    if "FAULT_TERM_AT" in os.environ:
        # A real SIGTERM, sent when the loop logs step S.
        from oases_jax.training.metrics import MetricsWriter
        log, at = MetricsWriter.write, int(os.environ["FAULT_TERM_AT"])

        def log_then_term(self, record):
            log(self, record)
            if record.get("step") == at and "loss" in record:
                os.kill(os.getpid(), signal.SIGTERM)

        MetricsWriter.write = log_then_term

    if "FAULT_NAN" in os.environ:
        # Resume with one parameter poisoned: the next loss is NaN; the compiled step is unchanged.
        import jax
        from oases_jax.training.checkpoint import Checkpointer
        restore = Checkpointer.restore

        def restore_poisoned(self, step, abstract_state, meta=None):
            state = restore(self, step, abstract_state, meta)
            leaves, tree = jax.tree.flatten(state["params"])
            leaves[0] = jax.device_put(leaves[0] * float("nan"), leaves[0].sharding)
            return state | {"params": jax.tree.unflatten(tree, leaves)}

        Checkpointer.restore = restore_poisoned

    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
    """
)


def cli_env(cache: pathlib.Path | None) -> dict:
    """CPU only, and nothing inherited that sets a device count or joins a cluster."""
    env = {k: v for k, v in os.environ.items() if k not in INHERIT_NOT and k[:5] != "SLURM"}
    flags = env.pop("XLA_FLAGS", "").split()
    env["XLA_FLAGS"] = " ".join(f for f in flags if "host_platform_device_count" not in f)
    env["JAX_PLATFORMS"] = "cpu"
    if cache is not None:
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    return env


def run_cli(*args, cache, cwd, timeout=300, **faults) -> subprocess.CompletedProcess:
    env = cli_env(cache) | {f"FAULT_{k.upper()}": str(v) for k, v in faults.items()}
    return subprocess.run(
        [sys.executable, "-c", FAULTS, str(TRAIN), *CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )


def config(**kw) -> TrainConfig:
    return TrainConfig(
        model=get_preset("tiny"),
        steps=STEPS,
        batch_size=8,
        seq_len=32,
        log_every=1,
        progress=False,
        **kw,
    )


def records(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def logged_losses(path: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records(path) if "loss" in r}


def steps_in(ckpt: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit())


def snapshot(path: pathlib.Path) -> dict[str, tuple]:
    """Every entry under `path`: files by mtime and content hash, directories by name."""
    return {
        str(p.relative_to(path)): (
            (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            if p.is_file()
            else "dir"
        )
        for p in sorted(path.rglob("*"))
    }


def host(state) -> tuple:
    return jax.device_get(state), jax.tree.map(lambda a: a.sharding, state)


# --- 1. resume is exact -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def inprocess(tmp_path_factory, jax_cache):
    """8 steps uninterrupted; 4 steps then a resume into the same checkpoints and metrics file."""
    root = tmp_path_factory.mktemp("inprocess")
    full = train(config(metrics_out=str(root / "full.jsonl")))
    saved, restored = {}, {}
    save, restore = Checkpointer.save, Checkpointer.restore

    def save_spy(self, step, state, meta):
        saved[step] = host(state)
        save(self, step, state, meta)

    def restore_spy(self, step, abstract_state, meta=None):
        state = restore(self, step, abstract_state, meta)
        restored[step] = host(state)  # before the first step donates the buffers
        return state

    ckpt = CheckpointConfig(dir=str(root / "ckpt"))
    metrics = str(root / "split.jsonl")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Checkpointer, "save", save_spy)
        mp.setattr(Checkpointer, "restore", restore_spy)
        first = train(config(ckpt=ckpt, stop_after=STOP, metrics_out=metrics))
        resumed = train(config(ckpt=dataclasses.replace(ckpt, resume=True), metrics_out=metrics))
    return types.SimpleNamespace(
        root=root, full=full, first=first, resumed=resumed, saved=saved, restored=restored
    )


def test_resumed_losses_are_bitwise_equal(inprocess):
    full, first, resumed = inprocess.full, inprocess.first, inprocess.resumed
    assert (first.stopped, first.final_step) == ("stop_after", STOP)
    assert (resumed.stopped, resumed.final_step) == ("done", STEPS)
    assert first.losses == {s: full.losses[s] for s in range(1, STOP + 1)}
    assert resumed.losses == {s: full.losses[s] for s in range(STOP + 1, STEPS + 1)}
    assert resumed.val_losses == full.val_losses and STEPS in full.val_losses


def test_restored_state_is_the_saved_state(inprocess):
    assert sorted(inprocess.saved) == [STOP, STEPS] and sorted(inprocess.restored) == [STOP]
    (saved, saved_sh), (restored, restored_sh) = inprocess.saved[STOP], inprocess.restored[STOP]
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    assert int(restored["step"]) == STOP
    leaves = zip(
        jax.tree_util.tree_leaves_with_path(saved),
        jax.tree.leaves(restored),
        jax.tree.leaves(saved_sh),
        jax.tree.leaves(restored_sh),
        strict=True,
    )
    for (path, a), b, a_sh, b_sh in leaves:
        name = jax.tree_util.keystr(path)
        np.testing.assert_array_equal(b, a, err_msg=name, strict=True)  # dtype and bits
        assert b_sh.is_equivalent_to(a_sh, a.ndim), (name, a_sh, b_sh)
    ckpt = Checkpointer(str(inprocess.root / "ckpt"), create=False)
    try:
        meta = ckpt.read_meta(STOP)
    finally:
        ckpt.close()
    assert (meta["step"], meta["data_step"], meta["seed"]) == (STOP, STOP, 0)


def test_metrics_file_continues(inprocess):
    def train_records(name):
        keep = ("step", "loss", "lr", "grad_norm", "val_loss")
        return [{k: r[k] for k in keep if k in r} for r in records(inprocess.root / name)]

    split, full = train_records("split.jsonl"), train_records("full.jsonl")
    assert [r["step"] for r in split if "loss" in r] == list(range(1, STEPS + 1))
    assert split == full


# --- 2. a crash inside a save, and SIGTERM ------------------------------------------------------


@pytest.fixture(scope="module")
def crash(tmp_path_factory, jax_cache, inprocess):
    """SIGKILL inside the save of step 3; resume and SIGTERM at step 5; resume to the end."""
    root = tmp_path_factory.mktemp("crash")
    ckpt = root / "ckpt"

    def run(name, *args, **faults):
        metrics = ("--metrics-out", str(root / f"{name}.jsonl"))
        return run_cli(
            "--ckpt-dir", str(ckpt), *metrics, *args, cache=jax_cache, cwd=root, **faults
        )

    killed = run("killed", kill_in_save=KILL)
    after_kill = snapshot(ckpt)
    reader = Checkpointer(str(ckpt), create=False)
    latest_after_kill = reader.latest_step()
    reader.close()
    termed = run("termed", "--resume", term_at=TERM)
    shutil.copytree(ckpt, root / "at_term")
    done = run("done", "--resume")
    return types.SimpleNamespace(
        root=root,
        ckpt=ckpt,
        reference=inprocess.full.losses,
        killed=killed,
        after_kill=after_kill,
        latest_after_kill=latest_after_kill,
        termed=termed,
        done=done,
    )


def test_kill_mid_save_leaves_previous_step(crash):
    assert crash.killed.returncode == -signal.SIGKILL, crash.killed.stderr[-3000:]
    tmp = f"{KILL}.orbax-checkpoint-tmp"
    # The kill came after array data reached the temporary directory, before the commit.
    assert any(p.startswith(f"{tmp}/") and "/d/" in p for p in crash.after_kill), crash.after_kill
    assert sorted(p for p in crash.after_kill if "/" not in p) == ["1", "2", tmp]
    assert crash.latest_after_kill == KILL - 1


def test_resume_after_kill_and_sigterm_is_exact(crash):
    for run in (crash.termed, crash.done):
        assert run.returncode == 0, run.stderr[-3000:]
        assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert f"steps {KILL}..{TERM} (signal)" in crash.termed.stdout
    assert f"steps {TERM + 1}..{STEPS} (done)" in crash.done.stdout
    resumed = logged_losses(crash.root / "termed.jsonl") | logged_losses(crash.root / "done.jsonl")
    assert resumed == {s: crash.reference[s] for s in range(KILL, STEPS + 1)}
    # Steps the killed run logged before dying (saving is asynchronous: maybe one past KILL).
    killed = logged_losses(crash.root / "killed.jsonl")
    assert killed and killed == {s: crash.reference[s] for s in killed}


def test_sigterm_ends_with_a_checkpoint(crash):
    assert steps_in(crash.root / "at_term")[-1] == TERM
    assert not [p for p in (crash.root / "at_term").iterdir() if not p.name.isdigit()]


def test_no_temporary_leftovers(crash):
    # Re-saving step 3 replaced its unfinished directory; keep=3 then retired 1..5.
    assert sorted(p.name for p in crash.ckpt.iterdir()) == ["6", "7", "8"]


# --- 3. refusals that protect data --------------------------------------------------------------


_XLA_LOG = re.compile(r"^(WARNING: All log messages before absl|[IWE]\d{4} \d\d:\d\d)")


def refused(proc, *needles, code=2) -> str:
    """One line on stderr, the exit code, no traceback; returns the line."""
    assert proc.returncode == code, (proc.returncode, proc.stderr[-3000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    # Lines logged by XLA's C++ runtime (e.g. the CUDA plugin of jax 0.11.2 reporting that no
    # driver is present) are not the program's output.
    lines = [ln for ln in proc.stderr.strip().splitlines() if not _XLA_LOG.match(ln)]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), proc.stderr[-3000:]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def test_refuses_existing_checkpoints_without_resume(crash, jax_cache, tmp_path):
    before = snapshot(crash.ckpt)
    proc = run_cli("--ckpt-dir", str(crash.ckpt), cache=jax_cache, cwd=tmp_path)
    refused(proc, str(crash.ckpt), f"latest step {STEPS}", "--resume")
    assert snapshot(crash.ckpt) == before


@pytest.mark.parametrize("missing", [False, True], ids=["empty", "missing"])
def test_refuses_resume_without_checkpoints(jax_cache, tmp_path, missing):
    ckpt = tmp_path / "ckpt"
    if not missing:
        ckpt.mkdir()
    proc = run_cli("--ckpt-dir", str(ckpt), "--resume", cache=jax_cache, cwd=tmp_path)
    refused(proc, str(ckpt), "no checkpoint", "drop --resume")
    assert ckpt.exists() != missing and not (ckpt.exists() and any(ckpt.iterdir()))


def test_refuses_another_model(crash, jax_cache, tmp_path):
    before = snapshot(crash.ckpt)
    args = ("--ckpt-dir", str(crash.ckpt), "--resume", "--model-set", "n_layers=3")
    refused(run_cli(*args, cache=jax_cache, cwd=tmp_path), "another model", "n_layers")
    assert snapshot(crash.ckpt) == before


def test_nan_loss_stops_and_keeps_the_last_checkpoint(crash, jax_cache, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(crash.root / "at_term", ckpt)
    before = snapshot(ckpt)
    proc = run_cli("--ckpt-dir", str(ckpt), "--resume", cache=jax_cache, cwd=tmp_path, nan=1)
    line = refused(proc, f"loss became nan at step {TERM + 1}", code=3)
    # Step TERM's (poisoned) weights produced the NaN: that checkpoint is set aside, not lost.
    assert f"set aside checkpoint(s) {TERM}.diverged" in line
    assert f"last good checkpoint: step {TERM - 1} in {ckpt}" in line
    moved = {re.sub(rf"^{TERM}(?=/|$)", f"{TERM}.diverged", k): v for k, v in before.items()}
    assert snapshot(ckpt) == moved
