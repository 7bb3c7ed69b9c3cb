"""Sharded training equals single-device training: 20 steps, every rule set, three meshes."""

import dataclasses

import jax
import numpy as np
import pytest

from oases_jax.models import get_preset
from oases_jax.training import ParallelConfig, TrainConfig, train

STEPS = 20
MESHES = ("data=8,tensor=1", "data=2,tensor=4", "data=1,tensor=8")
RULES = ("dp", "fsdp", "tp", "tp_sp")


def _config(mesh: str, rules: str, model: str = "tiny") -> TrainConfig:
    return TrainConfig(
        model=get_preset(model),
        parallel=ParallelConfig(mesh=mesh, rules=rules),
        steps=STEPS,
        batch_size=8,
        seq_len=32,
        log_every=STEPS,
        eval_every=STEPS,
        eval_batches=0,
        progress=False,
    )


@pytest.fixture(scope="module")
def reference():
    one = jax.devices()[:1]
    return {
        m: train(_config("data=1,tensor=1", "dp", m), devices=one).losses
        for m in ("tiny", "tiny-llama")
    }


@pytest.mark.parametrize("rules", RULES)
@pytest.mark.parametrize("mesh", MESHES)
def test_sharded_losses_match_single_device(reference, mesh, rules):
    losses = train(_config(mesh, rules)).losses
    ref = reference["tiny"]
    assert sorted(losses) == sorted(ref) == list(range(1, STEPS + 1))
    np.testing.assert_allclose([losses[s] for s in ref], list(ref.values()), rtol=1e-4)
    assert ref[STEPS] < ref[1]  # it learns


@pytest.mark.parametrize("rules", ["tp", "tp_sp"])
def test_llama_gqa_sharded_matches_single_device(reference, rules):
    losses = train(_config("data=2,tensor=4", rules, "tiny-llama")).losses
    ref = reference["tiny-llama"]
    np.testing.assert_allclose([losses[s] for s in ref], list(ref.values()), rtol=1e-4)


def test_gradient_accumulation_matches_one_big_batch(reference):
    cfg = _config("data=2,tensor=4", "tp")
    losses = train(dataclasses.replace(cfg, microbatches=2)).losses
    ref = reference["tiny"]
    np.testing.assert_allclose([losses[s] for s in ref], list(ref.values()), rtol=1e-4)
