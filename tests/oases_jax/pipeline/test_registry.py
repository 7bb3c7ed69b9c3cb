"""The pipeline schedule registry: one builder signature, the compatibility matrix as a table the
config follows, and every list derived from the records."""

import inspect
from fractions import Fraction

import pytest

from oases_jax import registry as tp_registry
from oases_jax.errors import UserError
from oases_jax.pipeline import registry
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.pipeline.validate import validate
from oases_jax.training import ParallelConfig

RUNNABLE = ("gpipe", "gpipe_spmd", "1f1b", "1f1b_spmd", "interleaved", "merak")
# Which tensor-parallel schedules run inside each pipeline's stages, written out by hand: the
# tick executor's switch cannot hold collective-permutes (rings, the square, XLA's windowed
# einsum); the pipelines with no per-stage control flow run every schedule.
NO_PERMUTES = {"megatron", "megatron_sp", "oases", "oases_sp"}
EVERY = set(tp_registry.SCHEDULES)
RUNS_INSIDE = {"gpipe": NO_PERMUTES, "1f1b": NO_PERMUTES, "interleaved": NO_PERMUTES,
               "merak": NO_PERMUTES, "gpipe_spmd": EVERY, "1f1b_spmd": EVERY}


def test_every_builder_has_the_one_signature():
    for spec in registry.PIPELINES.values():
        params = inspect.signature(spec.build).parameters
        assert list(params)[:2] == ["stages", "microbatches"], spec.name
        assert {"chunks", "recompute"} <= set(params), spec.name
        assert all(params[k].kind is inspect.Parameter.KEYWORD_ONLY
                   for k in ("chunks", "recompute")), spec.name
        assert params["chunks"].default == spec.chunks, spec.name


def test_the_records_list_the_schedules_in_order():
    assert registry.names(runnable=True) == RUNNABLE
    assert registry.names(runnable=False) == ("zb_h1",)
    assert registry.names(chunked=True) == ("interleaved",)
    assert registry.names(equal_stages=True) == ("gpipe_spmd", "1f1b_spmd")
    assert set(registry.stage_schedules()) == NO_PERMUTES


def _config(pipeline: str, schedule: str, **kw) -> ParallelConfig:
    square = tp_registry.get(schedule).square
    mesh = "stage=2,tp_row=2,tp_col=2" if square else "stage=2,tensor=4"
    return ParallelConfig(mesh=mesh, rules="primepar" if square else "tp", schedule=schedule,
                          pipeline=PipelineConfig(schedule=pipeline, **kw))


@pytest.mark.parametrize("pipeline", RUNNABLE)
def test_the_config_follows_the_compatibility_table(pipeline):
    """Each (pipeline, tensor-parallel schedule) pair is accepted exactly where the table says,
    and a refusal is one line naming both and the pipelines that would run it."""
    for schedule in sorted(EVERY):
        if schedule in RUNS_INSIDE[pipeline]:
            assert _config(pipeline, schedule).pipeline.schedule == pipeline
            continue
        with pytest.raises(UserError, match=f"--pipeline {pipeline} cannot run --schedule "
                           f"{schedule} inside its stages.*gpipe_spmd or 1f1b_spmd") as e:
            _config(pipeline, schedule)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("pipeline", RUNNABLE)
@pytest.mark.parametrize("flag,value", [("stage_layers", (1, 3)),
                                        ("remat_ratios", (Fraction(1, 2),)),
                                        ("backward_ticks", 2), ("fused_ticks", False),
                                        ("split_head", True)])
def test_per_stage_settings_only_where_stages_may_differ(pipeline, flag, value):
    equal = pipeline in ("gpipe_spmd", "1f1b_spmd")
    if not equal:
        assert getattr(_config(pipeline, "megatron", **{flag: value}).pipeline, flag) == value
        return
    with pytest.raises(UserError, match="runs one program on every stage"):
        _config(pipeline, "megatron", **{flag: value})


@pytest.mark.parametrize("pipeline", RUNNABLE)
def test_chunks_only_where_the_schedule_holds_them(pipeline):
    if pipeline == "interleaved":
        assert _config(pipeline, "megatron", virtual_stages=3).pipeline.virtual_stages == 3
        return
    with pytest.raises(UserError, match="--virtual-stages 3 needs a schedule with model chunks "
                       r"per stage \(interleaved\)"):
        _config(pipeline, "megatron", virtual_stages=3)


def test_zb_h1_is_a_record_refused_by_its_capability():
    """ZB-H1's table is built and valid; runs refuse it because its record has no executor,
    naming why and the schedules that run."""
    spec = registry.get("zb_h1")
    assert not spec.runnable and spec.executor is None
    validate(spec.table(4, 8))
    with pytest.raises(UserError, match="--pipeline zb_h1 splits each backward into B .* no "
                       "executor runs yet; use one of gpipe, gpipe_spmd, 1f1b"):
        _config("zb_h1", "megatron")
    with pytest.raises(UserError, match=r"unknown --pipeline 'zb_h9'.*\(zb_h1: no executor yet\)"):
        registry.get("zb_h9")


def test_every_consumer_lists_what_the_records_hold():
    from oases_jax.planner.plan_schema import PipelineEntry
    from oases_jax.planner.search import pipeline as pipeline_search
    from oases_jax.training import flags
    from oases_jax.training.pipeline_step import EXECUTORS

    assert pipeline_search.PIPELINES == RUNNABLE
    assert set(EXECUTORS) == set(registry.EXECUTORS)
    assert {registry.get(n).executor for n in RUNNABLE} <= set(EXECUTORS)
    entry = {"stages": 2, "stage_layers": [1, 1], "remat_ratios": ["0", "0"]}
    for name in RUNNABLE:
        assert PipelineEntry.model_validate({**entry, "schedule": name}).schedule == name
    with pytest.raises(Exception, match="zb_h1"):
        PipelineEntry.model_validate({**entry, "schedule": "zb_h1"})
    import argparse

    p = argparse.ArgumentParser()
    flags.add_layout_flags(p.add_argument_group("pipeline"))
    help_text = " ".join(p.format_help().split())
    assert all(name in help_text for name in RUNNABLE)
