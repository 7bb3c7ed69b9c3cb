"""Nothing trains on a damaged checkpoint, and the last good checkpoint after a divergence is good.

One uninterrupted run writes checkpoints 6, 7 and 8 (`--keep 3`); each test damages step 8 of a
copy as a disk or a user could (flipped bytes in an array file, a deleted array file, a FIFO in
its place, altered or garbled metadata), resumes, and checks the one line naming the damage,
the fallback to step 7, and that step 8 then trains exactly as it did uninterrupted. The
divergence tests wreck the weights after one step (as a bad update would), so the next step's
loss is NaN or a finite spike, and check which checkpoints are set aside and that training goes
on from the one named.
"""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.models import get_preset
from oases_jax.training import (
    CheckpointConfig,
    DivergenceConfig,
    OptimConfig,
    TrainConfig,
    TrainingDiverged,
    train,
)
from oases_jax.training.integrity import array_digests, sealed, unsealed
from oases_jax.training.program import StepProgram

ROOT = pathlib.Path(__file__).resolve().parents[2]
STEPS = 8


def config(directory: pathlib.Path, **kw) -> TrainConfig:
    ckpt_cfg = kw.pop("ckpt", CheckpointConfig(dir=str(directory), every=1, keep=3))
    return TrainConfig(model=get_preset("tiny"), steps=kw.pop("steps", STEPS), batch_size=8,
                       seq_len=32, log_every=1, eval_batches=0, progress=False, ckpt=ckpt_cfg,
                       **kw)


def resume(ckpt: pathlib.Path, **kw):
    return train(config(ckpt, ckpt=CheckpointConfig(dir=str(ckpt), every=1, keep=3,
                                                    resume=True), **kw))


def numbered(ckpt: pathlib.Path) -> list[str]:
    return sorted(p.name for p in ckpt.iterdir())


# --- the digest -----------------------------------------------------------------------------------


def _mix(h):
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def numpy_digest(x: np.ndarray) -> str:
    """The digest by hand, in 64-bit numpy integers (the reference for the jitted one)."""
    words = x.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[x.dtype.itemsize]).astype(np.int64)
    index = np.arange(words.size, dtype=np.int64).reshape(words.shape)
    h = _mix(words ^ _mix((index + 0x9E3779B9) & 0xFFFFFFFF))
    lanes = int(h.sum()) & 0xFFFFFFFF, int(_mix((h + 0x632BE5AB) & 0xFFFFFFFF).sum()) & 0xFFFFFFFF
    return "".join(f"{v:08x}" for v in lanes)


def test_digest_matches_the_hand_computation_and_ignores_sharding():
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    x = np.random.default_rng(0).standard_normal((8, 12)).astype(np.float32)
    tree = {"f32": x, "bf16": x.astype(jnp.bfloat16), "i32": np.arange(7, dtype=np.int32),
            "bool": x > 0}
    sharded = {**tree, "f32": jax.device_put(x, NamedSharding(mesh, P("a", "b"))),
               "bf16": jax.device_put(tree["bf16"], NamedSharding(mesh, P(None, "a")))}
    got = dict(map(tuple, array_digests(sharded)))
    want = {f"['{k}']": numpy_digest(np.asarray(v).astype(np.uint8) if k == "bool"
                                     else np.asarray(v)) for k, v in tree.items()}
    assert got == want == dict(map(tuple, array_digests(tree)))
    flipped, swapped = x.copy(), x.copy()
    flipped.view(np.uint32)[3, 5] ^= 1 << 7
    swapped[[0, 1]] = swapped[[1, 0]]
    digests = {numpy_digest(a) for a in (x, flipped, swapped)}
    assert len(digests) == 3


def test_metadata_digest():
    meta = sealed({"step": 3, "seed": 0, "model": {"d_model": 64}})
    assert unsealed(json.loads(json.dumps(meta))) == ({k: meta[k] for k in meta if k != "digest"},
                                                      None)
    altered = {**meta, "seed": 1}
    assert unsealed(altered)[1] == "its metadata does not match its digest"
    assert unsealed({"step": 3}) == ({"step": 3}, None)  # written before digests


# --- damage on resume ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base(tmp_path_factory, jax_cache):
    root = tmp_path_factory.mktemp("integrity")
    result = train(config(root / "ckpt"))
    assert numbered(root / "ckpt") == ["6", "7", "8"]
    return root, result.losses


def _array_files(step_dir: pathlib.Path) -> list[pathlib.Path]:
    return sorted((step_dir / "state").glob("ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)


def _flip(step_dir: pathlib.Path) -> None:
    """Four bytes XORed in the middle of the largest array file."""
    path = _array_files(step_dir)[-1]
    data = bytearray(path.read_bytes())
    mid = len(data) // 2
    data[mid:mid + 4] = bytes(b ^ 0x5A for b in data[mid:mid + 4])
    path.write_bytes(bytes(data))


def _fifo(step_dir: pathlib.Path) -> None:
    path = _array_files(step_dir)[-1]
    path.unlink()
    os.mkfifo(path)


def _alter_meta(step_dir: pathlib.Path) -> None:
    """Valid JSON that says something else: the seed changed."""
    path = step_dir / "meta" / "metadata"
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, "seed": 1}))


DAMAGE = {
    "flipped-bytes": (_flip, "array"),
    "deleted-array-file": (lambda d: _array_files(d)[-1].unlink(), "unreadable"),
    "truncated-array-file": (lambda d: os.truncate(_array_files(d)[-1], 100), "unreadable"),
    "fifo": (_fifo, "is a FIFO, not a regular file"),
    "altered-metadata": (_alter_meta, "its metadata does not match its digest"),
    "garbled-metadata": (lambda d: (d / "meta" / "metadata").write_bytes(b"{\"st\x00"),
                         "unreadable"),
    "garbage-manifest": (lambda d: (d / "state" / "manifest.ocdbt").write_bytes(b"\x5a" * 118),
                         "unreadable"),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_step_is_set_aside_and_the_previous_resumes_exactly(base, tmp_path, capfd,
                                                                      kind):
    root, reference = base
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    damage, reason = DAMAGE[kind]
    damage(ckpt / "8")
    result = resume(ckpt)
    lines = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("checkpoint:")]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"checkpoint: step 8 in {ckpt} is damaged (") and reason in lines[0]
    assert lines[0].endswith("set aside as 8.damaged; falling back to step 7"), lines[0]
    assert result.losses == {8: reference[8]}  # step 8 again, from step 7's weights: exact
    assert numbered(ckpt) == ["6", "7", "8", "8.damaged"]


def test_no_intact_checkpoint_exits_6(base, tmp_path, jax_cache):
    root, _ = base
    ckpt = tmp_path / "ckpt"
    shutil.copytree(root / "ckpt", ckpt)
    for step in ("6", "7", "8"):
        _flip(ckpt / step)
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env |= {"JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(jax_cache)}
    args = ("--model", "tiny", "--steps", "8", "--batch-size", "8", "--seq-len", "32",
            "--eval-batches", "0", "--no-progress", "--ckpt-dir", str(ckpt), "--resume",
            "--metrics-out", str(tmp_path / "m.jsonl"))
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 6, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("train.py: error:")]
    assert len(errors) == 1 and "no intact checkpoint" in errors[0], proc.stderr[-3000:]
    assert numbered(ckpt) == ["6.damaged", "7.damaged", "8.damaged"]


# --- divergence -----------------------------------------------------------------------------------


BAD_AFTER = 10  # the weights after this step's update are wrecked


def _wrecking(factor: float):
    """StepProgram.compile returning a step whose update at BAD_AFTER scales every weight."""
    compile_ = StepProgram.compile

    def compile_wrecking(self, extra=None):
        step_fn = compile_(self, extra)

        def step(state, batch):
            state, m = step_fn(state, batch)
            if int(np.asarray(state["step"].addressable_data(0))) == BAD_AFTER:
                state = {**state, "params": jax.tree.map(lambda w: w * factor, state["params"])}
            return state, m

        return step

    return compile_wrecking


@pytest.mark.parametrize("factor", [float("nan"), 100.0], ids=["nan", "finite-spike"])
def test_divergence_keeps_a_good_checkpoint_that_trains_on(tmp_path, jax_cache, monkeypatch,
                                                           factor):
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.jsonl"
    cfg = config(ckpt, steps=12, ckpt=CheckpointConfig(dir=str(ckpt), every=1, keep=1),
                 metrics_out=str(metrics))
    monkeypatch.setattr(StepProgram, "compile", _wrecking(factor))
    with pytest.raises(TrainingDiverged) as e:
        train(cfg)
    line, bad = str(e.value), BAD_AFTER + 1
    if factor != factor:
        assert line.startswith(f"loss became nan at step {bad}; stopped without saving it")
    else:
        assert line.startswith("loss ") and "spiked past --loss-spike 10 x the median" in line
        assert f"at step {bad};" in line
    # Checkpoint 10 holds the wrecked weights that step 11 computed from: set aside, and step 9,
    # the last one a sane step trained from, kept though --keep is 1.
    assert f"set aside checkpoint(s) {BAD_AFTER}.diverged" in line
    assert f"last good checkpoint: step {BAD_AFTER - 1} in {ckpt}" in line
    assert numbered(ckpt) == [f"{BAD_AFTER}.diverged", str(BAD_AFTER - 1)]
    logged = {r["step"]: r["loss"] for r in map(json.loads, metrics.read_text().splitlines())
              if "loss" in r}
    assert sorted(logged) == list(range(1, BAD_AFTER + 1))  # the bad step is not logged
    monkeypatch.undo()
    resumed = train(dataclasses.replace(
        cfg, steps=BAD_AFTER - 1 + 20, optim=OptimConfig(lr=cfg.optim.lr / 3),
        metrics_out=str(tmp_path / "resumed.jsonl"),
        ckpt=CheckpointConfig(dir=str(ckpt), every=5, keep=1, resume=True)))
    assert sorted(resumed.losses) == list(range(BAD_AFTER, BAD_AFTER + 20))
    # Step 10's loss comes from step 9's weights, before the update: the same as first logged.
    assert resumed.losses[BAD_AFTER] == logged[BAD_AFTER]
    losses = [resumed.losses[s] for s in sorted(resumed.losses)]
    assert all(np.isfinite(losses)) and np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.05, losses


def test_divergence_config_is_checked():
    from oases_jax.errors import UserError

    for bad in (dict(loss_spike=0.5), dict(loss_spike=float("nan")),
                dict(grad_norm_limit=-1.0), dict(spike_window=0)):
        with pytest.raises(UserError):
            DivergenceConfig(**bad)


def test_guard_by_hand():
    from oases_jax.training.loop import _Guard

    guard = _Guard(DivergenceConfig(loss_spike=10.0, grad_norm_limit=100.0))
    for loss in (5.0, 6.0, 4.0, 5.0, 5.5, 4.5, 5.0, 5.0):  # median 5.0 once 8 are seen
        assert guard.verdict(loss, 1.0) is None
    assert guard.verdict(49.0, 1.0) is None  # under 10 x 5.0
    assert "spiked past --loss-spike 10 x the median 5 of the last 9 steps" in \
        guard.verdict(51.0, 1.0)
    assert guard.verdict(5.0, 150.0) == "gradient norm 150 passed --grad-norm-limit 100"
    assert guard.verdict(5.0, float("inf")) == "gradient norm became inf"
    assert guard.verdict(float("nan"), 1.0) == "loss became nan"
    early = _Guard(DivergenceConfig())
    assert early.verdict(5.0, 1.0) is None and early.verdict(500.0, 1.0) is None  # too few seen
