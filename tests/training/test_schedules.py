"""Every tensor-parallel schedule computes what the single-device model computes: one block's
outputs and gradients, and 30 training steps of the tiny model against `megatron`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oases_jax import registry
from oases_jax.layer_plan import LayerSpec
from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.models.layers import Block, block_fns
from oases_jax.models.sharding import param_shardings
from oases_jax.models.transformer import FAMILY_NORM
from oases_jax.rules import constrain, get_rules
from oases_jax.stacks import Parallel, run_layer, use_parallel
from oases_jax.training import ParallelConfig, TrainConfig, train

MESHES = ("data=1,tensor=8", "data=2,tensor=4", "data=4,tensor=2")
STEPS = 30
# primepar needs a tp_row x tp_col square: tests/training/test_primepar_training.py
TENSOR_SCHEDULES = registry.names(square=False)


def _block_fwd_bwd(cfg, schedule, mesh):
    parallel = ParallelConfig(mesh="data=-1", schedule=schedule)
    rules = get_rules(parallel.rules_name)
    block = Block(cfg, FAMILY_NORM[cfg.family], rngs=nnx.Rngs(3))
    graphdef, params = nnx.split(block)
    x = jax.random.normal(jax.random.key(1), (4, 32, cfg.d_model))
    ct = jax.random.normal(jax.random.key(2), x.shape)

    def f(p, x):
        y = nnx.merge(graphdef, p)(x)
        return jnp.sum(y * ct), y

    def f_sharded(p, x):  # the block as the runtime runs it in a train step
        parallel = Parallel(mesh, rules, LayerSpec(schedule=schedule, sub_batches=2))
        with use_parallel(parallel):
            y = run_layer(parallel.segment(parallel.default), block_fns(graphdef), p,
                          constrain(x, ("batch", "seq", "embed")))
            return jnp.sum(y * ct), y

    if mesh is None:
        return _value_and_grads(f, params, x)
    params = jax.device_put(params, param_shardings(params, rules, mesh))
    with jax.set_mesh(mesh):
        return _value_and_grads(f_sharded, params, x)


def _value_and_grads(f, params, x):
    (_, y), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(params, x)
    return y, grads


@pytest.mark.parametrize("model", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("schedule", TENSOR_SCHEDULES)
def test_block_matches_single_device(model, schedule):
    cfg = get_preset(model)
    y_ref, g_ref = _block_fwd_bwd(cfg, "megatron", None)
    y, g = _block_fwd_bwd(cfg, schedule, make_mesh("data=2,tensor=4"))
    np.testing.assert_allclose(y, y_ref, rtol=1e-4, atol=1e-5)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def _losses(schedule, mesh):
    cfg = TrainConfig(
        model=get_preset("tiny"),
        parallel=ParallelConfig(mesh=mesh, schedule=schedule),
        steps=STEPS,
        batch_size=8,
        seq_len=32,
        log_every=STEPS,
        eval_batches=0,
        progress=False,
    )
    return train(cfg).losses


@pytest.fixture(scope="module")
def megatron_losses():
    return {mesh: _losses("megatron", mesh) for mesh in MESHES}


@pytest.mark.slow
@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("schedule", [s for s in TENSOR_SCHEDULES if s != "megatron"])
def test_training_matches_megatron(megatron_losses, schedule, mesh):
    ref = megatron_losses[mesh]
    got = _losses(schedule, mesh)
    np.testing.assert_allclose([got[s] for s in ref], list(ref.values()), rtol=1e-4)


def _layer_collectives(schedule, remat):
    from oases_jax.tools.analysis.program import analyze
    from oases_jax.training.program import CompileSpec, lower

    cfg = get_preset("tiny").replace(remat=remat)
    mesh = make_mesh("data=2,tensor=4")
    spec = CompileSpec(
        model=cfg,
        parallel=ParallelConfig(mesh="data=2,tensor=4", schedule=schedule),
        batch_size=8,
        seq_len=32,
        layer=True,
    )
    analysis = analyze(lower(spec, mesh).compile(), mesh)[0]
    return analysis.counts_by_kind(), analysis


@pytest.mark.parametrize("schedule", ["megatron", "collective_matmul", "oases", "oases_cm"])
def test_recomputation_is_communication_free(schedule):
    """With `save_proj` remat a layer's forward+backward has exactly the collectives it has
    without remat; with full remat the recomputed forward adds its collectives again."""
    plain, _ = _layer_collectives(schedule, "none")
    saved, _ = _layer_collectives(schedule, "save_proj")
    full, _ = _layer_collectives(schedule, "full")
    assert saved == plain
    assert sum(full.values()) > sum(plain.values())


_H100_SHAPES = {"small": ({}, 256), "gpt2-1.5b": ({"n_heads": 32, "head_dim": 50}, 1024)}


def _h100_layer(model, schedule):
    return _h100_inspection(model, schedule).analysis


@functools.cache
def _h100_inspection(model, schedule, dtype="float32"):
    from oases_jax.targets import get_target, has_gpu_aot
    from oases_jax.tools.inspection import inspect_program
    from oases_jax.training.program import CompileSpec

    if not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    overrides, seq = _H100_SHAPES[model]
    spec = CompileSpec(model=get_preset(model).replace(**overrides, dtype=dtype), batch_size=8,
                       seq_len=seq, layer=True,
                       parallel=ParallelConfig(mesh="tensor=8", schedule=schedule))
    return inspect_program(spec, get_target("h100:8"))


@pytest.mark.gpu_aot
@pytest.mark.parametrize("model, schedule", [
    pytest.param(model, schedule, id=f"{schedule}-{model}")
    for schedule in ("collective_matmul", "oases", "oases_cm") for model in _H100_SHAPES
])
def test_overlapped_layer_hides_collectives_on_h100(model, schedule):
    """One layer forward+backward for 8 H100s with tensor=8: at least 90% of the tensor-parallel
    bytes move in async collectives with a GEMM inside their window. Under `oases` one of its
    eight equal all-reduces (k = 2) has none by construction: the layer's last, mlp(1)'s, whose
    result the program's value needs at once (in a stack the next layer's attn(0) hides it,
    `test_overlapped_stack_*`)."""
    analysis = _h100_layer(model, schedule)
    floor = 1 - 1 / 8 if schedule == "oases" else 0.9
    assert analysis.overlap_share(require="gemm", axes=["tensor"]) >= floor - 1e-9


@pytest.mark.gpu_aot
def test_oases_backward_hides_each_dx_all_reduce_behind_another_sub_batch():
    """One bf16 GPT-2 1.5B layer (k = 2) for 8 H100s: its four backward all-reduces (each
    sub-layer's dX, in the order mlp(1) mlp(0) attn(1) attn(0)) each have the next sub-layer's
    backward GEMMs covering most of their simulated time (`step_order.tie_backward`; without it
    XLA ran attn(1)'s and attn(0)'s back to back after both attention backwards, covered 0.29
    and 0.17). attn(0)'s, the layer's last, has nothing left beside it in a one-layer program."""
    windows = _h100_inspection("gpt2-1.5b", "oases", "bfloat16").sim.windows
    ar = [w for w in windows if w.kind == "all-reduce"]
    assert len(ar) == 8
    backward = [w.share for w in ar[4:]]
    assert min(backward[:3]) >= 0.8, backward


@pytest.mark.gpu_aot
@pytest.mark.parametrize("model", list(_H100_SHAPES))
def test_megatron_layer_overlaps_little_on_h100(model):
    # Megatron's forward all-reduces wait for their projection; only backward ones can overlap
    # the independent weight-gradient GEMMs that XLA schedules beside them.
    analysis = _h100_layer(model, "megatron")
    assert analysis.overlap_share(require="gemm", axes=["tensor"]) <= 0.5


def _stack_loss_and_grads(cfg, schedule, mesh, plan=None, rules="tp"):
    from oases_jax.models.transformer import Transformer, cross_entropy

    rules = get_rules(rules)
    graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    params = jax.device_put(params, param_shardings(params, rules, mesh))
    tokens = jax.random.randint(jax.random.key(1), (8, 33), 0, cfg.vocab_size)

    def loss(p, t):
        parallel = Parallel(mesh, rules, LayerSpec(schedule=schedule, sub_batches=2),
                            tuple(plan) if plan else None)
        with use_parallel(parallel):
            logits = nnx.merge(graphdef, p)(t[:, :-1])
            return cross_entropy(logits, t[:, 1:], cfg.vocab_size)

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(loss))(params, tokens)


@pytest.mark.parametrize("schedule, remat, scan, plan", [
    ("oases", "none", True, None), ("oases", "save_proj", True, None),
    ("oases", "full", False, None), ("oases_sp", "none", True, None),
    ("oases_sp", "save_proj", True, None), ("oases_sp", "full", False, None),
    ("oases", "none", True, ("oases", "oases", "megatron")),
    ("oases", "none", True, ("megatron", "oases", "oases")),
    ("oases_sp", "none", True, ("oases_sp", "megatron", "oases")),
])
def test_overlapped_oases_stack_matches_megatron(schedule, remat, scan, plan):
    """`oases` and `oases_sp` run a stack of layers overlapped across layers
    (`oases_jax.stacks`): three layers, scanned or unrolled, under remat, and as segments of a
    per-layer plan, give megatron's loss and gradients."""
    cfg = get_preset("tiny").replace(n_layers=3, remat=remat, scan_layers=scan)
    mesh = make_mesh("data=2,tensor=4")
    layers = plan and [LayerSpec(schedule=s, sub_batches=2 if registry.get(s).sub_batches
                                 else 1, remat=remat) for s in plan]
    ref_loss, ref_grads = _stack_loss_and_grads(cfg, "megatron", mesh)
    loss, grads = _stack_loss_and_grads(cfg, "megatron" if plan else schedule, mesh, layers,
                                        rules="tp_sp" if schedule == "oases_sp" else "tp")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("sub_batches", [2, 1])
def test_oases_under_fsdp_tp_matches_megatron(sub_batches):
    """Under FSDP x tensor parallel the layer-wide shard_maps (the overlapped stack with two
    sub-batches, one shard_map per layer with one) gather each layer's parameters over `data`
    themselves, and give megatron's loss and gradients, sharded as stored."""
    cfg = get_preset("tiny").replace(n_layers=3)
    mesh = make_mesh("data=2,tensor=4")
    ref_loss, ref_grads = _stack_loss_and_grads(cfg, "megatron", mesh)
    layers = [LayerSpec(schedule="oases", sub_batches=sub_batches)] * cfg.n_layers
    loss, grads = _stack_loss_and_grads(cfg, "megatron", mesh, layers, rules="fsdp_tp")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    embed_in = grads["blocks"]["mlp"]["w_in"]
    assert "data" in str(jax.tree.leaves(embed_in)[0].sharding.spec)  # still FSDP-sharded


def test_overlapped_stack_recomputation_is_communication_free():
    """The whole train step of a overlapped `oases` stack: `save_proj` remat issues exactly the
    collectives of no remat (the pending all-reduce's result is saved in the next layer), full
    remat issues more."""
    from oases_jax.tools.analysis.program import analyze
    from oases_jax.training.program import CompileSpec, lower

    mesh = make_mesh("data=2,tensor=4")

    def counts(remat):
        spec = CompileSpec(model=get_preset("tiny").replace(n_layers=3, remat=remat),
                           parallel=ParallelConfig(mesh="data=2,tensor=4", schedule="oases"),
                           batch_size=8, seq_len=32)
        return analyze(lower(spec, mesh).compile(), mesh)[0].counts_by_kind()

    plain, saved, full = counts("none"), counts("save_proj"), counts("full")
    assert saved == plain
    assert sum(full.values()) > sum(plain.values())


@pytest.mark.gpu_aot
def test_oases_train_step_overlaps_across_layers_on_h100():
    """The whole train step of `small` (4 layers, scanned) for 8 H100s with tensor=8. Each
    layer's last all-reduce (mlp of the last sub-batch) used to end its scan iteration with no
    GEMM left to hide behind (share 0.611); the overlapped stack issues it beside the next
    layer's attn(0) (0.702; the rest is the embedding's and the head's all-reduces, the one
    completed after the stack, and attn(k-1)'s, which XLA closes before mlp(0)'s GEMMs)."""
    from oases_jax.targets import get_target, has_gpu_aot
    from oases_jax.tools.inspection import inspect_program
    from oases_jax.training.program import CompileSpec

    if not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    spec = CompileSpec(model=get_preset("small"), batch_size=8, seq_len=256,
                       parallel=ParallelConfig(mesh="tensor=8", schedule="oases"))
    analysis = inspect_program(spec, get_target("h100:8")).analysis
    assert analysis.overlap_share(require="gemm", axes=["tensor"]) >= 0.65
