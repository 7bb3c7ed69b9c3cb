"""Training an MoE model on 8 CPU devices (data=2,expert=2,tensor=2, --moe-schedule auto): the
loss falls, the router losses and dropped fraction are logged, and a resumed run continues
exactly (bitwise-equal losses and router metrics)."""

import dataclasses
import json

import pytest

from oases_jax.models import get_preset
from oases_jax.training import CheckpointConfig, ParallelConfig, TrainConfig, train

pytestmark = pytest.mark.slow  # CI runs it (`make test MARK=...`)

STEPS, STOP = 8, 4


def _config(**kw) -> TrainConfig:
    return TrainConfig(model=get_preset("tiny-moe").replace(capacity_factor=1.0),
                       parallel=ParallelConfig(mesh="data=2,expert=2,tensor=2",
                                               moe_schedule="auto"),
                       steps=STEPS, batch_size=8, seq_len=32, log_every=1, eval_every=STEPS,
                       eval_batches=1, progress=False, **kw)


def _records(path):
    return [json.loads(line) for line in open(path) if '"loss"' in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    full = train(_config(metrics_out=str(root / "full.jsonl")))
    ckpt = CheckpointConfig(dir=str(root / "ckpt"))
    split = str(root / "split.jsonl")
    first = train(_config(ckpt=ckpt, stop_after=STOP, metrics_out=split))
    resumed = train(_config(ckpt=dataclasses.replace(ckpt, resume=True), metrics_out=split))
    return root, full, first, resumed


def test_loss_falls_and_router_metrics_are_logged(runs):
    root, full, _, _ = runs
    assert full.losses[STEPS] < full.losses[1]
    recs = _records(root / "full.jsonl")
    assert len(recs) == STEPS
    for r in recs:
        assert {"ce_loss", "aux_loss", "z_loss", "dropped_frac"} <= set(r)
        assert 0.9 < r["aux_loss"] < 2.0 and 0.0 <= r["dropped_frac"] < 1.0
        assert r["loss"] > r["ce_loss"]  # the objective adds the weighted router losses
    assert any(r["dropped_frac"] > 0 for r in recs)  # capacity factor 1.0 drops some choices


def test_resume_is_exact(runs):
    root, full, first, resumed = runs
    assert first.losses == {s: full.losses[s] for s in range(1, STOP + 1)}
    assert resumed.losses == {s: full.losses[s] for s in range(STOP + 1, STEPS + 1)}
    full_recs = _records(root / "full.jsonl")
    split_recs = _records(root / "split.jsonl")
    keys = ("loss", "ce_loss", "aux_loss", "z_loss", "dropped_frac", "grad_norm")
    assert [{k: r[k] for k in keys} for r in split_recs] == [{k: r[k] for k in keys}
                                                            for r in full_recs]
    assert resumed.val_losses == full.val_losses
