"""The planner against measurements: variant -> layout mapping, the rank correlation by hand."""

import math

import pytest

from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.presets import get_preset
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import step_cost
from oases_jax.planner.layout import Layout
from oases_jax.planner.verification.rank import (
    layout_of,
    predict_pipeline_step_s,
    predict_step_s,
    ranks,
    spearman,
)


def test_spearman_by_hand():
    # d = (0, 1, 1, 0): 1 - 6 * 2 / (4 * 15) = 0.8.
    assert spearman([1, 2, 3, 4], [10, 30, 20, 40]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert list(ranks([5.0, 1.0, 5.0, 2.0])) == [3.5, 1.0, 3.5, 2.0]  # ties share 3 and 4
    # With ties it is Pearson's r of the ranks (1, 2.5, 2.5) and (1, 2, 3): 0.866.
    assert spearman([1, 2, 2], [1, 2, 3]) == pytest.approx(math.sqrt(3) / 2)
    with pytest.raises(ValueError, match="same length"):
        spearman([1, 2], [1])


def test_variants_map_to_layouts():
    kw = {"global_batch": 16, "seq_len": 128}
    assert layout_of("data=8", "dp", **kw) == Layout(data=8, **kw)
    assert layout_of("data=8", "fsdp", **kw) == Layout(fsdp=8, **kw)
    assert layout_of("data=2,tensor=4", "fsdp_tp", **kw) == Layout(fsdp=2, tensor=4, **kw)
    assert layout_of("data=2,tensor=4", "tp_sp", **kw) == Layout(data=2, tensor=4, **kw)
    assert layout_of("data=2,tp_row=2,tp_col=2", "primepar", **kw) is None
    with pytest.raises(ValueError, match="shard over all replicas"):
        Layout(data=2, fsdp=2, tensor=2, **kw)


def test_prediction_is_the_step_cost_of_the_uniform_plan():
    cfg = get_preset("small")
    hw = Hardware.of(get_cluster("h100-8"))
    kw = {"global_batch": 16, "seq_len": 128}
    got = predict_step_s(cfg, hw, mesh="data=2,tensor=4", rules="tp", schedule="oases",
                         sub_batches=2, **kw)
    want = step_cost(cfg, Layout(data=2, tensor=4, **kw),
                     [LayerSpec(schedule="oases", sub_batches=2)] * cfg.n_layers, hw).step_s
    assert got == want
    assert predict_step_s(cfg, hw, mesh="data=2,tensor=4", rules="tp_sp", schedule="xla_auto",
                          sub_batches=2, **kw) is None
    # Accumulated: the step of the layout with its micro-batches (bench.py --microbatches).
    got4 = predict_step_s(cfg, hw, mesh="data=2,tensor=4", rules="tp", schedule="oases",
                          sub_batches=2, microbatches=4, **kw)
    want4 = step_cost(cfg, Layout(data=2, tensor=4, microbatches=4, **kw),
                      [LayerSpec(schedule="oases", sub_batches=2)] * cfg.n_layers, hw).step_s
    assert got4 == want4 and got4 > got


def test_a_pipelined_variant_is_priced_as_the_3d_search_prices_it():
    """bench.py --predict on a pipelined variant: the 3D search's price of its uniform stages
    (every layer recomputed under remat full); FSDP rules price FSDP inside the stages; a remat
    policy the stage model does not take, or axes it does not know, give None."""
    from oases_jax.planner.search.pipeline import price, stage_inputs, transfer_s
    from oases_jax.planner.search.stage_partition import fixed

    cfg = get_preset("small").replace(remat="full")
    hw = Hardware.of(get_cluster("h100-8"))
    kw = {"global_batch": 32, "seq_len": 128, "microbatches": 4}
    one_f = PipelineConfig(schedule="1f1b")
    got = predict_pipeline_step_s(cfg, hw, mesh="stage=2,data=4", rules="tp",
                                  schedule="megatron", pipeline=one_f, **kw)
    lay = Layout(data=4, **kw)
    spec = LayerSpec(schedule="megatron")
    x = stage_inputs(cfg, lay, hw, spec)
    p2p = transfer_s(cfg, lay, hw, spec, 2)
    half = cfg.n_layers // 2
    sp = fixed(x, schedule="1f1b", counts=[half, half], remat=[half, half], microbatches=4,
               p2p=p2p)
    assert got == price(cfg, hw, 2, lay, spec, sp, x, p2p).step_s
    # Interleaved: two chunks a device, priced with the same per-layer inputs.
    inter = predict_pipeline_step_s(cfg, hw, mesh="stage=2,data=4", rules="tp",
                                    schedule="megatron",
                                    pipeline=PipelineConfig(schedule="interleaved"), **kw)
    spi = fixed(x, schedule="interleaved", counts=[half, half], remat=[half, half],
                microbatches=4, chunks=2, p2p=p2p)
    assert inter == price(cfg, hw, 2, lay, spec, spi, x, p2p).step_s
    fsdp = predict_pipeline_step_s(cfg, hw, mesh="stage=2,data=4", rules="fsdp",
                                   schedule="megatron", pipeline=one_f, **kw)
    assert fsdp is not None and fsdp != got
    assert predict_pipeline_step_s(cfg.replace(remat="save_proj"), hw, mesh="stage=2,data=4",
                                   rules="tp", schedule="megatron", pipeline=one_f,
                                   **kw) is None
    assert predict_pipeline_step_s(cfg, hw, mesh="stage=2,tp_row=2,tp_col=2", rules="primepar",
                                   schedule="primepar", pipeline=one_f, **kw) is None


def test_a_pipelined_variant_prices_its_stage_aware_ratios():
    """bench.py --predict with --remat-ratios: stage i recomputes its first floor(n_i r_i)
    layers, as the program runs it; Merak's rule from r0 = 0.5 on 2 stages gives 0.5 and 0."""
    from oases_jax.planner.search.pipeline import price, stage_inputs, transfer_s
    from oases_jax.planner.search.stage_partition import fixed

    cfg = get_preset("small")
    hw = Hardware.of(get_cluster("h100-8"))
    kw = {"global_batch": 32, "seq_len": 128, "microbatches": 4}
    lay = Layout(data=4, **kw)
    spec = LayerSpec(schedule="megatron")
    x = stage_inputs(cfg, lay, hw, spec)
    p2p = transfer_s(cfg, lay, hw, spec, 2)
    half = cfg.n_layers // 2

    def expect(schedule, remat):
        sp = fixed(x, schedule=schedule, counts=[half, half], remat=remat, microbatches=4,
                   p2p=p2p)
        return price(cfg, hw, 2, lay, spec, sp, x, p2p).step_s

    def got(schedule, ratios):
        return predict_pipeline_step_s(cfg, hw, mesh="stage=2,data=4", rules="tp",
                                       schedule="megatron",
                                       pipeline=PipelineConfig(schedule=schedule,
                                                               remat_ratios=ratios), **kw)

    assert got("1f1b", (0.5,)) == expect("1f1b", [half // 2, 0]) != got("1f1b", None)
    assert got("1f1b", None) == expect("1f1b", [0, 0])
    # Merak's stage 0 is recomputed whole by its schedule whatever its ratio.
    assert got("merak", (0.5,)) == got("merak", None) == expect("merak", [half, 0])
