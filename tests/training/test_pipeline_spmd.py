"""`--pipeline gpipe_spmd` (training/pipeline_spmd.py): GPipe with no per-stage control flow, so
the ring schedules run inside the stages. Loss and every gradient equal the non-pipelined model
on one device (the helpers of test_pipeline.py), NaN-filled receive and output buffers
included; the compiled program holds the ring's
collective-permutes over `tensor` and no conditional; a train run agrees with the tick
executor's GPipe."""

from __future__ import annotations

import jax
import pytest

from oases_jax.layer_plan import LayerSpec
from oases_jax.mesh import make_mesh
from oases_jax.models.layout import layout_fns
from oases_jax.models.sharding import param_shardings
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.rules import get_rules
from oases_jax.stacks import Parallel, use_parallel
from oases_jax.training import pipeline_spmd
from oases_jax.training import pipeline_step as ps
from oases_jax.training.state import accumulation_groups
from tests.training.test_pipeline import _assert_equal, _reference, _tokens


def _spmd(cfg, params, tokens, mesh_text, *, tp="megatron", rules="tp", poison=False,
          pipeline="gpipe_spmd"):
    mesh = make_mesh(mesh_text, jax.devices())
    rules = get_rules(rules)
    pipe = ps.pipeline_spec(cfg, PipelineConfig(schedule=pipeline), stages=mesh.shape["stage"],
                            microbatches=tokens.shape[0])
    parallel = Parallel(mesh, rules, LayerSpec(schedule=tp))
    groups = accumulation_groups(rules, mesh)
    # PrimePar's square stores each projection weight block-permuted (models.layout), its
    # gradients too: the stages get the stored layout, the gradients go back to the standard.
    to_stored, to_standard = layout_fns(tp, rules, mesh)
    staged = ps.to_stages(to_stored(jax.device_put(params, param_shardings(params, rules, mesh))),
                          pipe)
    staged = jax.device_put(staged, ps.stage_shardings(staged, rules, mesh))

    def step(p, t):
        with use_parallel(parallel):
            fn = (pipeline_spmd.spmd_1f1b_grads if pipeline == "1f1b_spmd"
                  else pipeline_spmd.spmd_pipeline_grads)
            return fn(cfg, pipe, parallel, p, t, groups, poison=poison)

    with jax.set_mesh(mesh):
        loss, grads = jax.jit(step)(staged, tokens)
    grads = ps.from_stages(grads, pipe)
    return loss, to_standard(jax.device_put(grads, param_shardings(grads, rules, mesh)))


FAST = [  # (mesh, tensor-parallel schedule, rules, M, NaN-filled buffers)
    ("stage=2,tensor=4", "collective_matmul", "tp", 2, False),
    ("data=2,stage=2,tensor=2", "oases_cm", "tp", 3, False),
    ("stage=4,tensor=2", "megatron", "tp", 5, True),
]
SLOW = [
    ("stage=8", "megatron", "tp", 8, True),
    ("data=2,stage=4", "megatron", "fsdp", 5, False),
    ("stage=4,tensor=2", "oases", "tp", 4, False),
    ("data=2,stage=2,tensor=2", "megatron_sp", "tp_sp", 2, False),
    ("stage=4,tensor=2", "collective_matmul", "tp", 11, True),
    ("data=2,stage=2,tensor=2", "megatron", "tp", 3, False),
    ("data=2,stage=2,tensor=2", "megatron", "fsdp_tp", 2, True),
]


@pytest.mark.parametrize(("mesh", "tp", "rules", "m", "poison"),
                         FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_equals_one_device(model, mesh, tp, rules, m, poison):
    cfg, graphdef, params = model
    tokens = _tokens(cfg, m)
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _spmd(cfg, params, tokens, mesh, tp=tp, rules=rules, poison=poison))


FAST_1F1B = [  # (mesh, tensor-parallel schedule, rules, M, NaN-filled buffers)
    ("stage=2,tensor=4", "collective_matmul", "tp", 2, True),
    ("stage=4,tensor=2", "megatron", "tp", 5, True),
    # PrimePar's square inside the stages (its embedding lookup and loss written so that
    # XLA's partitioner can run them inside the stage loop: oases_jax.embedding, models.loss).
    ("stage=2,tp_row=2,tp_col=2", "primepar", "primepar", 5, True),
]
SLOW_1F1B = [
    ("data=2,stage=2,tensor=2", "megatron", "fsdp_tp", 3, False),
    ("stage=8", "megatron", "tp", 8, True),
    ("stage=4,tensor=2", "megatron", "tp", 3, True),  # M < S: no steady 1F1B on stage 0
    ("data=2,stage=4", "megatron", "fsdp", 11, False),
    ("data=2,stage=2,tensor=2", "oases_cm", "tp", 7, False),
    ("data=2,stage=2,tensor=2", "megatron_sp", "tp_sp", 2, False),
]


@pytest.mark.parametrize(("mesh", "tp", "rules", "m", "poison"),
                         FAST_1F1B + [pytest.param(*c, marks=pytest.mark.slow)
                                      for c in SLOW_1F1B])
def test_1f1b_equals_one_device(model, mesh, tp, rules, m, poison):
    """1F1B with no per-stage control flow (the rings inside its stages): loss and every
    gradient equal one device, NaN-filled receive buffers and input slots included."""
    cfg, graphdef, params = model
    tokens = _tokens(cfg, m)
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _spmd(cfg, params, tokens, mesh, tp=tp, rules=rules, poison=poison,
                        pipeline="1f1b_spmd"))


def _variant(cfg, **changes):
    """`cfg` changed, initialised on one device: (config, graphdef, parameters)."""
    from flax import nnx

    from oases_jax.models.sharding import init_sharded

    cfg = cfg.replace(**changes)
    one = make_mesh("data=1", jax.devices()[:1])
    graphdef, params = nnx.split(init_sharded(cfg, get_rules("dp"), one, 0))
    return cfg, graphdef, params


@pytest.mark.parametrize(("changes", "mesh", "split"), [
    # An untied [D, V] head, its vocabulary split over tensor=4 inside each block of 2 stages.
    ({"tie_embeddings": False}, "stage=2,tensor=4", True),
    # 100 rows do not split into 4 stages x 2 tensor blocks: every stage runs the whole head.
    ({"vocab_size": 100, "vocab_multiple": 4}, "stage=4,tensor=2", False),
])
def test_head_vocabulary_over_stages(model, changes, mesh, split):
    """The head and loss split over `stage` by vocabulary (or, where the padded vocabulary does
    not divide, run whole on every stage) equal one device, tied and untied."""
    from oases_jax.training.pipeline_spmd import vocab_shards

    cfg, graphdef, params = _variant(model[0], **changes)
    m = make_mesh(mesh, jax.devices())
    shards = vocab_shards(cfg, Parallel(m, get_rules("tp")), {"stage"})
    assert (cfg.padded_vocab % (m.shape["stage"] * shards) == 0) == split
    tokens = _tokens(cfg, 3)
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _spmd(cfg, params, tokens, mesh, poison=True))


def test_vocab_part_and_split_loss_by_hand():
    """`vocab_part` gives stage s piece s of every tensor block, with the ids of its rows; the
    split loss over 4 devices equals `cross_entropy` on the whole vocabulary, value and
    gradient."""
    import jax.numpy as jnp
    import numpy as np

    from oases_jax.models.loss import cross_entropy, split_cross_entropy
    from oases_jax.training.pipeline_spmd import vocab_part

    V, D, S, shards = 16, 3, 2, 2  # blocks of 8 rows, pieces of 4
    table = jnp.arange(V * D, dtype=jnp.float32).reshape(V, D)
    part, ids = vocab_part(table, True, jnp.int32(1), S, shards)
    np.testing.assert_array_equal(ids, [4, 5, 6, 7, 12, 13, 14, 15])
    np.testing.assert_array_equal(part, table[ids])
    part_t, ids_t = vocab_part(table.T, False, jnp.int32(0), S, shards)
    np.testing.assert_array_equal(ids_t, [0, 1, 2, 3, 8, 9, 10, 11])
    np.testing.assert_array_equal(part_t, table.T[:, ids_t])

    n, vocab = 4, 14  # 2 padded rows
    logits = jax.random.normal(jax.random.key(0), (2, 3, V))
    targets = jax.random.randint(jax.random.key(1), (2, 3), 0, vocab)
    mesh = make_mesh("data=4", jax.devices()[:n])
    pieces = jnp.stack([jnp.arange(V)[j::n] for j in range(n)])  # device j: ids j, j+4, ...

    def local(lg_, ids_):  # each device seeds its own copy of the loss
        loss, g = jax.value_and_grad(split_cross_entropy)(lg_[:, :, 0], targets, ids_[0],
                                                           vocab, "data")
        return loss[None], g[:, :, None]

    by_device = logits[:, :, pieces]  # [2, 3, n, V/n]
    losses, g = jax.jit(jax.shard_map(
        local, mesh=mesh, in_specs=(jax.P(None, None, "data"), jax.P("data")),
        out_specs=(jax.P("data"), jax.P(None, None, "data"))))(by_device, pieces)
    want, want_g = jax.value_and_grad(lambda lg: cross_entropy(lg, targets, vocab))(logits)
    np.testing.assert_allclose(losses, np.full(n, want), rtol=1e-6)
    got_g = jnp.zeros_like(logits).at[:, :, pieces].set(g)
    np.testing.assert_allclose(got_g, want_g, atol=1e-7)


def test_compiled_ring_permutes_and_no_switch():
    """The compiled step (CPU, through training/program.py) has no conditional, the ring's
    collective-permutes over `tensor` inside the stages, and stage-to-stage transfers between
    neighbours only: forward s -> s+1, their autodiff transposes s+1 -> s, never the
    wrap-around edge between the first and the last stage."""
    from oases_jax.models import get_preset
    from oases_jax.tools.analysis import hlo
    from oases_jax.training import ParallelConfig
    from oases_jax.training.program import CompileSpec, lower
    from tests.training.test_pipeline_hlo import _walk

    cfg = get_preset("tiny").replace(n_layers=4, d_model=128, d_ff=512)
    mesh_text = "stage=4,tensor=2"  # device d: stage d // 2, tensor d % 2
    spec = CompileSpec(model=cfg, parallel=ParallelConfig(
        mesh=mesh_text, rules="tp", schedule="collective_matmul",
        pipeline=PipelineConfig(schedule="gpipe_spmd")),
        batch_size=8, seq_len=64, microbatches=4)
    module = hlo.parse_module(lower(spec, make_mesh(mesh_text, jax.devices())).compile()
                              .as_text())
    every = list(_walk(module, module.computations[module.entry]))
    assert not [i for i in every if i.opcode == "conditional"]
    permutes = [hlo.source_target_pairs(i) for i in every
                if i.opcode.startswith("collective-permute") and not i.opcode.endswith("-done")]
    within = [p for pairs in permutes for p in pairs if p[0] // 2 == p[1] // 2]
    across = [pairs for pairs in permutes if any(a // 2 != b // 2 for a, b in pairs)]
    assert within, "no ring collective-permute inside the stages"
    assert across, "no stage-to-stage transfer"
    for pairs in across:  # one direction per transfer, one stage apart
        steps = {(b // 2) - (a // 2) for a, b in pairs}
        assert steps in ({1}, {-1}), sorted(pairs)
