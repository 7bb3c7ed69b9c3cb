"""Pipelined training through the one compile path: 20 steps agree with the non-pipelined run,
checkpoints hold the standard layout and resume exactly (and onto another stage count), and
bad pipeline input is one line naming the value and the fix."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec
from oases_jax.models import get_preset
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.training import CheckpointConfig, ParallelConfig, TrainConfig, train

STEPS = 20


def _config(mesh: str, pipeline: str | None = None, *, ckpt: CheckpointConfig | None = None,
            stop_after: int | None = None, schedule: str = "megatron", rules: str = "tp",
            **settings) -> TrainConfig:
    """`settings`: the pipeline's (`PipelineConfig`'s fields) beside its schedule."""
    pipe = PipelineConfig(schedule=pipeline, **settings) if pipeline else None
    return TrainConfig(
        model=get_preset("tiny").replace(n_layers=4),
        parallel=ParallelConfig(mesh=mesh, schedule=schedule, rules=rules, pipeline=pipe),
        steps=STEPS, batch_size=16, seq_len=32, microbatches=4, log_every=STEPS,
        eval_every=STEPS, eval_batches=1, progress=False, ckpt=ckpt or CheckpointConfig(),
        stop_after=stop_after,
    )


@pytest.fixture(scope="module")
def reference():
    return train(_config("data=1,tensor=1"), devices=jax.devices()[:1]).losses


def test_twenty_steps_agree(reference):
    got = train(_config("data=2,stage=2,tensor=2", "1f1b")).losses
    np.testing.assert_allclose([got[s] for s in reference], list(reference.values()), rtol=1e-4)
    assert reference[STEPS] < reference[1] - 0.3


@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["gpipe_spmd", "1f1b_spmd"])
def test_spmd_pipelines_with_rings_train_alike(reference, pipeline):
    """Twenty steps of gpipe_spmd and 1f1b_spmd with collective_matmul's rings inside the
    stages (its own sequence-parallel rules) agree with the non-pipelined run."""
    got = train(_config("stage=2,tensor=4", pipeline, schedule="collective_matmul")).losses
    np.testing.assert_allclose([got[s] for s in reference], list(reference.values()), rtol=1e-4)


@pytest.mark.slow
def test_primepar_square_inside_stages_trains_and_resumes(reference, tmp_path):
    """PrimePar's square inside 1f1b_spmd's two stages: ten steps agree with the non-pipelined
    run, and the checkpoint (the standard layout, not the square's block-permuted one) is
    continued by a tick executor's 1F1B with fsdp_tp on data=2,stage=2,tensor=2."""
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=10)
    first = train(_config("stage=2,tp_row=2,tp_col=2", "1f1b_spmd", schedule="primepar",
                          rules="primepar", ckpt=ckpt, stop_after=10))
    np.testing.assert_allclose([first.losses[s] for s in range(1, 11)],
                               [reference[s] for s in range(1, 11)], rtol=1e-4)
    resumed = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=10, resume=True)
    other = train(_config("data=2,stage=2,tensor=2", "1f1b", rules="fsdp_tp",
                          ckpt=resumed)).losses
    np.testing.assert_allclose([other[s] for s in range(11, STEPS + 1)],
                               [reference[s] for s in range(11, STEPS + 1)], rtol=1e-4)


@pytest.mark.slow
def test_uneven_stages_with_ratios_train_alike(reference):
    got = train(_config("data=2,stage=4", "merak", stage_layers=(1, 1, 1, 1),
                        remat_ratios=(0.8,))).losses
    np.testing.assert_allclose([got[s] for s in reference], list(reference.values()), rtol=1e-4)


@pytest.mark.slow
def test_resume_is_exact_and_moves_between_stage_counts(reference, tmp_path):
    full = train(_config("data=2,stage=2,tensor=2", "1f1b")).losses
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=10)
    first = train(_config("data=2,stage=2,tensor=2", "1f1b", ckpt=ckpt, stop_after=10))
    assert first.final_step == 10
    resumed = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=10, resume=True)
    second = train(_config("data=2,stage=2,tensor=2", "1f1b", ckpt=resumed)).losses
    assert [second[s] for s in range(11, STEPS + 1)] == [full[s] for s in range(11, STEPS + 1)]
    # The checkpoint holds the standard layout: a run on four stages (and one without a
    # pipeline) continues it.
    moved = CheckpointConfig(dir=str(tmp_path / "ckpt2"), every=10)
    train(_config("data=2,stage=2,tensor=2", "1f1b", ckpt=moved, stop_after=10))
    moved = CheckpointConfig(dir=str(tmp_path / "ckpt2"), every=10, resume=True)
    other = train(_config("data=2,stage=4", "gpipe", ckpt=moved)).losses
    np.testing.assert_allclose([other[s] for s in range(11, STEPS + 1)],
                               [full[s] for s in range(11, STEPS + 1)], rtol=1e-4)


@pytest.mark.slow
def test_spmd_checkpoint_resumes_under_the_tick_executor(reference, tmp_path):
    """1f1b_spmd's checkpoint holds the standard layout too: ten steps with the rings inside
    its two stages, then a tick executor's GPipe on four stages continues them as the
    non-pipelined run would."""
    ckpt = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=10)
    first = train(_config("stage=2,tensor=4", "1f1b_spmd", schedule="collective_matmul",
                          ckpt=ckpt, stop_after=10))
    assert first.final_step == 10
    resumed = CheckpointConfig(dir=str(tmp_path / "ckpt"), every=10, resume=True)
    other = train(_config("data=2,stage=4", "gpipe", ckpt=resumed)).losses
    np.testing.assert_allclose([other[s] for s in range(11, STEPS + 1)],
                               [reference[s] for s in range(11, STEPS + 1)], rtol=1e-4)


@pytest.mark.parametrize(("overrides", "words"), [
    (dict(mesh="data=2,stage=4", microbatches=2, pipeline="merak"),
     "at least as many micro-batches as stages"),
    (dict(mesh="data=2,stage=4", pipeline="1f1b", stage_layers="1,1,1,2"), "sum to 5"),
    (dict(mesh="data=2,stage=4"), "no --pipeline"),
    (dict(mesh="data=2,tensor=4", pipeline="1f1b"), "needs a stage axis"),
    (dict(mesh="data=2,stage=4", pipeline="zb_h1"), "zb_h1 splits each backward.*no executor"),
    (dict(mesh="data=2,stage=4", pipeline="zb_h2"), "unknown --pipeline"),
    (dict(mesh="stage=2,tp_row=2,tp_col=2", pipeline="1f1b", schedule="primepar",
          rules="primepar"),
     "1f1b cannot run --schedule primepar inside its stages.*gpipe_spmd or 1f1b_spmd"),
    (dict(mesh="data=2,stage=4", pipeline="interleaved", microbatches=4), "split into v=2"),
    (dict(mesh="stage=2,tensor=4", pipeline="1f1b", schedule="collective_matmul"),
     "cannot run --schedule collective_matmul inside its stages"),
    (dict(mesh="stage=2,tp_row=2,tp_col=2", pipeline="gpipe_spmd", schedule="primepar",
          rules="primepar"), "gpipe_spmd with --schedule primepar deadlocks XLA:CPU.*1f1b_spmd"),
    (dict(mesh="stage=2,tp_row=2,tp_col=2", pipeline="merak", schedule="primepar"),
     "merak cannot run --schedule primepar inside its stages"),
    (dict(mesh="data=2,stage=4", pipeline="gpipe_spmd", remat_ratios="0.5"),
     "one program on every stage.*--remat-ratios"),
    (dict(mesh="stage=4,tensor=2", pipeline="gpipe_spmd", stage_layers="1,1,1,1"),
     "one program on every stage.*--stage-layers"),
    (dict(mesh="stage=4,tensor=2", pipeline="gpipe_spmd", model_layers=5),
     "gpipe_spmd.*5 layers do not split into 4 equal stages"),
    (dict(mesh="stage=4,tensor=2", pipeline="1f1b_spmd", model_layers=6),
     "1f1b_spmd.*6 layers do not split into 4 equal stages.*--pipeline 1f1b$"),
    (dict(mesh="stage=2,tensor=4", pipeline="1f1b_spmd", backward_ticks=2),
     "1f1b_spmd runs one program on every stage.*--backward-ticks"),
    (dict(mesh="stage=2,tensor=4", pipeline="1f1b", fused_ticks="on", backward_ticks=2),
     "--fused-ticks on runs each backward in one tick, not --backward-ticks 2"),
    (dict(mesh="stage=2,tensor=4", pipeline="1f1b", fused_ticks="yes"),
     "unknown --fused-ticks 'yes': choose auto, on or off"),
    (dict(mesh="data=2,tensor=4", fused_ticks="on"), "--fused-ticks on needs --pipeline"),
    (dict(mesh="stage=2,tensor=4", pipeline="gpipe_spmd", fused_ticks="off"),
     "gpipe_spmd runs one program on every stage.*--fused-ticks off"),
    (dict(mesh="data=2,tensor=4", split_head="on"), "--split-head on needs --pipeline"),
    (dict(mesh="stage=2,tensor=4", pipeline="1f1b_spmd", split_head="on"),
     "1f1b_spmd runs one program on every stage.*--split-head on"),
    (dict(mesh="data=2,stage=4", pipeline="1f1b", split_head="on", seq_len=30),
     "--split-head on splits each micro-batch's 30 positions over 4 stages: use a --seq-len "
     "divisible by 4"),
    (dict(mesh="stage=2,tensor=4", pipeline="1f1b", split_head="maybe"),
     "unknown --split-head 'maybe': choose on or off"),
    (dict(mesh="stage=2,tensor=4", pipeline="1f1b_spmd", layers=(
        LayerSpec(schedule="megatron"), LayerSpec(schedule="oases", sub_batches=2)) * 2),
     "one --schedule for every layer"),
    (dict(mesh="stage=2,tensor=4", pipeline="1f1b", layers=(
        LayerSpec(schedule="megatron"), LayerSpec(schedule="collective_matmul")) * 2),
     "cannot run the plan's collective_matmul layers inside its stages"),
])
def test_bad_input_is_one_line(overrides, words):
    """The pipeline settings as the command line spells them (`PipelineConfig.from_flags`)."""
    overrides = dict(overrides)
    m = overrides.pop("microbatches", 4)
    schedule = overrides.pop("schedule", "megatron")
    layers = overrides.pop("model_layers", 4)
    seq_len = overrides.pop("seq_len", 32)
    par = dict(mesh=overrides.pop("mesh"), rules=overrides.pop("rules", "tp"),
               layers=overrides.pop("layers", None))
    with pytest.raises(UserError, match=words) as err:
        pipe = PipelineConfig.from_flags(pipeline=overrides.pop("pipeline", None), **overrides)
        cfg = TrainConfig(model=get_preset("tiny").replace(n_layers=layers),
                          parallel=ParallelConfig(schedule=schedule, pipeline=pipe, **par),
                          steps=2, batch_size=16, seq_len=seq_len, microbatches=m,
                          progress=False)
        from oases_jax.mesh import make_mesh
        from oases_jax.training.loop import step_program
        step_program(cfg, make_mesh(cfg.parallel.mesh, jax.devices()))
    assert "\n" not in str(err.value)
