"""One step model: the same layers priced through the dense, 3D (one stage) and MoE (no MoE
layers) paths get the same step-level terms, and those terms are the hand-written formulas."""

import pytest

from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models import get_preset
from oases_jax.planner.cost.moe_step import MoEChoice, moe_static_memory, moe_step_cost
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import OPTIMIZER_PASSES, step_cost
from oases_jax.planner.layout import Layout, replica_group
from oases_jax.planner.search.pipeline import price, stage_inputs
from oases_jax.planner.search.stage_partition import fixed

CFG = get_preset("gpt2-1.5b").replace(dtype="bfloat16", n_layers=8)
STRATEGY = LayerSpec(schedule="megatron")


def _three_paths(layout: Layout, hw: Hardware):
    dense = step_cost(CFG, layout, [STRATEGY] * CFG.n_layers, hw)
    x = stage_inputs(CFG, layout, hw, STRATEGY)
    sp = fixed(x, schedule="1f1b", counts=[CFG.n_layers], remat=[0],
               microbatches=layout.microbatches)
    staged = price(CFG, hw, 1, layout, STRATEGY, sp, x, 0.0)
    moe = moe_step_cost(CFG, layout, STRATEGY, MoEChoice("parm_s1"), hw)
    return dense, staged, moe


@pytest.mark.parametrize("mesh", [dict(data=4, tensor=2), dict(fsdp=8), dict(fsdp=4, tensor=2)])
def test_dense_3d_and_moe_paths_add_the_same_step_terms(mesh):
    hw = Hardware.of(get_cluster("h100-8"))
    layout = Layout(**mesh, microbatches=4, global_batch=32, seq_len=1024)
    dense, staged, moe = _three_paths(layout, hw)
    assert dense.terms == staged.terms
    if layout.fsdp == 1:  # the MoE search has no FSDP layouts
        assert moe.cost.terms == dense.terms
        static = ("params", "grads", "optimizer", "compute_weights", "grad_accumulator")
        assert {k: moe.cost.memory[k] for k in static} \
            == pytest.approx({k: dense.memory[k] for k in static})

    # By hand: the fp32 gradients of every local parameter all-reduced over the replicas (over
    # `data` under fsdp), all of it waited for after the accumulated micro-batch loop; AdamW's
    # passes and the cast; twelve bytes a parameter per micro-batch for the accumulator.
    local = CFG.param_count() / (layout.tensor * layout.fsdp)
    group = ([i * layout.tensor * layout.fsdp for i in range(layout.data)] if layout.fsdp > 1
             else replica_group(layout))
    terms = dense.terms
    assert terms.reduce_s == pytest.approx(hw.comm_s("all-reduce", 4 * local, group))
    assert terms.exposed_reduce_s == terms.reduce_s
    assert terms.accumulate_s == pytest.approx(4 * hw.mem_s(12 * local))
    assert terms.update_s > hw.mem_s(OPTIMIZER_PASSES * 4 * local)  # plus the bf16 cast
    assert (terms.clip_s > 0) == (layout.fsdp > 1)
    # bf16: the weight matrices' gradients in 2 bytes, their cast copy once per step.
    mats = CFG.n_layers * (4 * 1600**2 + 2 * 1600 * 6400) / (layout.tensor * layout.fsdp)
    assert dense.memory["grads"] == pytest.approx(4 * local - 2 * mats)


def test_nothing_after_the_layer_loop_hides_the_moe_steps_reduction():
    """The MoE step adds its whole gradient reduction after the loop, as the dense step does
    (it used to let half the head's time hide it)."""
    hw = Hardware.of(get_cluster("h100-8"))
    cfg = get_preset("small-moe").replace(dtype="bfloat16")
    layout = Layout(data=2, expert=2, tensor=2, microbatches=2, global_batch=16, seq_len=512)
    got = moe_step_cost(cfg, layout, STRATEGY, MoEChoice("parm_s1"), hw)
    t = got.cost.terms
    assert t.exposed_reduce_s == t.reduce_s == got.reduce_s > 0


def test_moe_experts_gradients_are_written_in_the_compute_dtype():
    """Every expert's stacked weights pass the one cast (`models.layers.compute_weights`), so
    their gradients are bf16 as the dense matrices' are (the MoE step used to count them fp32)."""
    cfg = get_preset("small-moe").replace(dtype="bfloat16")  # 2 MoE layers of 8 experts
    layout = Layout(data=2, expert=2, tensor=2, global_batch=16, seq_len=512)
    mem = moe_static_memory(cfg, layout)
    d, f, e = 256, 1024, 8
    experts = 2 * e * (2 * d * f + f) / 4 + 2 * e * d / 2  # over expert x tensor; b_out over ep
    dense_mats = (cfg.n_layers * 4 * d * d + (cfg.n_layers - 2) * 2 * d * cfg.ff_dim) / 2
    local = mem["params"] / 4
    assert mem["grads"] == pytest.approx(4 * local - 2 * (experts + dense_mats))
