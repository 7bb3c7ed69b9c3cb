"""Pipeline exactness: the loss and every gradient (embedding, tied head, final norm, every
block) of a pipelined step equal the non-pipelined model's on one device, for each schedule on
meshes stage=8; data=2,stage=4; data=2,stage=2,tensor=2 (megatron, megatron_sp and oases inside the
stages),
with M in {S, S+1, 2S+3}; NaN-filled bubbles and buffers change nothing."""

from __future__ import annotations

from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oases_jax.layer_plan import LayerSpec
from oases_jax.mesh import make_mesh
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.rules import get_rules
from oases_jax.stacks import Parallel, use_parallel
from oases_jax.training import pipeline_step as ps
from oases_jax.training.state import accumulation_groups, loss_fn

ROWS, SEQ = 4, 16  # rows per micro-batch, sequence length


def _tokens(cfg, m: int) -> jax.Array:
    return jax.random.randint(jax.random.key(m), (m, ROWS, SEQ + 1), 0, cfg.vocab_size)


def _reference(cfg, graphdef, params, tokens):
    """Mean loss and gradients over the micro-batches, one device, no pipeline."""
    def one(p, t):
        out = loss_fn(graphdef, p, t, cfg.vocab_size)
        return out[0] if isinstance(out, tuple) else out

    losses, grads = jax.jit(jax.vmap(jax.value_and_grad(one), in_axes=(None, 0)))(params, tokens)
    return losses.mean(), jax.tree.map(lambda g: g.mean(0), grads)


def _pipelined(cfg, params, tokens, mesh_text, schedule, *, tp="megatron", poison=False,
               rules="tp", plan=None, sub_batches=1, **pipeline):
    """The pipelined step's loss and gradients under `PipelineConfig(schedule, **pipeline)`."""
    mesh = make_mesh(mesh_text, jax.devices())
    rules = get_rules(rules)
    pipe = ps.pipeline_spec(cfg, PipelineConfig(schedule=schedule, **pipeline),
                            stages=mesh.shape["stage"], microbatches=tokens.shape[0])
    parallel = Parallel(mesh, rules, LayerSpec(schedule=tp, sub_batches=sub_batches), plan)
    groups = accumulation_groups(rules, mesh)
    staged = jax.device_put(ps.to_stages(params, pipe),
                            ps.stage_shardings(ps.to_stages(params, pipe), rules, mesh))

    def step(p, t):
        with use_parallel(parallel):
            return ps.pipeline_grads(cfg, pipe, parallel, p, t, groups, poison=poison)

    with jax.set_mesh(mesh):
        loss, grads = jax.jit(step)(staged, tokens)
    return loss, ps.from_stages(grads, pipe)


def _assert_equal(ref, got):
    (rl, rg), (pl, pg) = ref, got
    np.testing.assert_allclose(float(pl), float(rl), rtol=1e-6)
    scale = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(rg))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(rg), jax.tree.leaves(pg),
                            strict=True):
        a, b = np.asarray(a), np.asarray(b)
        # 1e-5 of each tensor's largest element. The key bias's gradient is zero in exact
        # arithmetic (softmax ignores a shift shared by every key), so both sides hold rounding
        # noise near 1e-12: it is held to 1e-5 of the model's largest gradient instead.
        bound = 1e-5 * (np.abs(a).max() if np.abs(a).max() > 1e-6 * scale else scale)
        assert np.abs(a - b).max() <= bound, (jax.tree_util.keystr(path),
                                              np.abs(a - b).max(), bound)


FAST = [  # (mesh, schedule, M as a function of S)
    ("data=2,stage=4", "1f1b", "S"),
    ("data=2,stage=2,tensor=2", "merak", "2S+3"),  # fused: two forwards a tick send
    # A one-stage pipeline: the tick loop, pools and stage program with no transfers.
    ("data=4,stage=1,tensor=2", "1f1b", "2S+3"),
]
SLOW = [(mesh, sched, m) for mesh in ("stage=8", "data=2,stage=4", "data=2,stage=2,tensor=2")
        for sched, m in (("gpipe", "S"), ("1f1b", "2S+3"), ("interleaved", "S"),
                         ("merak", "S+1"), ("1f1b", "S+1"), ("merak", "2S+3"))
        if (mesh, sched, m) not in FAST and not (mesh == "stage=8" and sched == "interleaved")
        ] + [("data=4,stage=1,tensor=2", "gpipe", "S+1"), ("data=4,stage=1,tensor=2", "merak", "S")]


def _m(rule: str, s: int) -> int:
    return {"S": s, "S+1": s + 1, "2S+3": 2 * s + 3}[rule]


def _stages(mesh_text: str) -> int:
    return int(dict(kv.split("=") for kv in mesh_text.split(","))["stage"])


@pytest.mark.parametrize(("mesh", "schedule", "m"), FAST)
def test_pipeline_equals_one_device(model, mesh, schedule, m):
    cfg, graphdef, params = model
    tokens = _tokens(cfg, _m(m, _stages(mesh)))
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, mesh, schedule))


FUSED = [  # (mesh, schedule, M, --fused-ticks): each the table its default does not pick
    pytest.param("data=2,stage=2,tensor=2", "1f1b", "S+1", False),
    pytest.param("data=2,stage=2,tensor=2", "merak", "2S+3", False),
    pytest.param("data=2,stage=4", "gpipe", "S", True, marks=pytest.mark.slow),
    pytest.param("data=2,stage=4", "interleaved", "S", False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mesh", "schedule", "m", "fused"), FUSED)
def test_fused_and_unfused_tick_tables(model, mesh, schedule, m, fused):
    """Both tick tables of a schedule compute the same step: a fused tick's lanes (a stage's run
    of actions; `--fused-ticks`) run in order on a stage, with NaN-filled bubbles and
    buffers. The defaults (fused: 1F1B and Merak's at S=2, interleaved; unfused: GPipe) are
    the other tests' tables."""
    cfg, graphdef, params = model
    S = _stages(mesh)
    pipe = ps.pipeline_spec(cfg, PipelineConfig(schedule=schedule, fused_ticks=fused),
                            stages=S, microbatches=_m(m, S))
    assert pipe.fused() == fused != ps.pipeline_spec(
        cfg, PipelineConfig(schedule=schedule), stages=S, microbatches=_m(m, S)).fused()
    tokens = _tokens(cfg, _m(m, S))
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, mesh, schedule, poison=True,
                             fused_ticks=fused))


@pytest.mark.slow
@pytest.mark.parametrize(("mesh", "schedule", "m"), SLOW)
def test_every_schedule_mesh_and_m(model, mesh, schedule, m):
    cfg, graphdef, params = model
    tokens = _tokens(cfg, _m(m, _stages(mesh)))
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, mesh, schedule))


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "m"), [("1f1b", "S+1"), ("merak", "2S+3")])
def test_fsdp_tp_inside_stages(model, schedule, m):
    """FSDP beside Megatron inside the tick executor's stages (`--rules fsdp_tp`): its
    embedding lookup runs per device inside the stage loop (oases_jax.embedding)."""
    cfg, graphdef, params = model
    tokens = _tokens(cfg, _m(m, 2))
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, "data=2,stage=2,tensor=2", schedule,
                             rules="fsdp_tp", poison=True))


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "merak"])
def test_oases_inside_the_stages(model, schedule):
    cfg, graphdef, params = model
    tokens = _tokens(cfg, 3)
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, "data=2,stage=2,tensor=2", schedule,
                             tp="oases"))


@pytest.mark.parametrize(("mesh", "schedule", "tp"), [
    ("data=2,stage=2,tensor=2", "1f1b", "megatron_sp"),
    pytest.param("stage=2,tensor=4", "merak", "megatron_sp", marks=pytest.mark.slow),
    ("data=2,stage=2,tensor=2", "1f1b", "oases_sp")])
def test_megatron_sp_inside_the_stages(model, mesh, schedule, tp):
    """Sequence parallelism inside the stages (its own rule set, the residual stream sharded
    over `tensor` by tokens), learned positions included: no collective-permute inside the
    tick's switch, where it deadlocked (the token shift and position rows are taken outside
    the loop), and the same loss and gradients; `oases_sp`'s sub-batches too."""
    cfg, graphdef, params = model
    assert cfg.learned_positions
    tokens = _tokens(cfg, 3 if tp == "megatron_sp" else 4)
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, mesh, schedule, tp=tp, rules="tp_sp",
                             sub_batches=2 if tp == "oases_sp" else 1))


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("interleaved",
                                                            marks=pytest.mark.slow)])
def test_fsdp_inside_the_stages(model, schedule):
    """FSDP inside the stages (`--rules fsdp`: the parameters sharded over `data`, which GSPMD
    gathers inside each tick's branch and whose gradients it reduce-scatters)."""
    cfg, graphdef, params = model
    tokens = _tokens(cfg, 4)
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, "data=2,stage=4", schedule, rules="fsdp"))


@pytest.mark.parametrize(("schedule", "layers", "ratios"), [
    ("1f1b", (3, 5), None),
    pytest.param("interleaved", None, None, marks=pytest.mark.slow),
    pytest.param("merak", (3, 5), (Fraction(1, 2),), marks=pytest.mark.slow),
])
def test_per_layer_plan_inside_the_stages(model, schedule, layers, ratios, monkeypatch):
    """A per-layer plan (megatron, oases with 2 sub-batches, megatron_sp-free mixes, each
    layer its own remat) pipelined: each stage runs its own layers' strategies (a stage
    boundary inside a run of oases layers too), the stage-aware ratios recomputing their first
    layers whatever those layers' own policy (under `merak` stage 0, recomputed whole by the
    schedule, keeps every residual instead; its last stage holds the rematted layers), and the
    same loss and gradients."""
    cfg, graphdef, params = model
    plan = tuple(LayerSpec(schedule=s, sub_batches=k, remat=r) for s, k, r in [
        ("megatron", 1, "none"), ("oases", 2, "none"), ("oases", 2, "full"),
        ("megatron", 1, "full"), ("oases", 2, "save_proj"), ("megatron", 1, "none"),
        ("megatron", 1, "none"), ("oases", 2, "none")])
    assert len(plan) == cfg.n_layers
    seen = []  # the (schedule, sub-batches, remat) of every segment the stages trace
    segment = Parallel.segment
    monkeypatch.setattr(Parallel, "segment", lambda self, layer: (
        seen.append((layer.schedule, layer.sub_batches, layer.remat)), segment(self, layer))[1])
    tokens = _tokens(cfg, 4)
    ref = _reference(cfg, graphdef, params, tokens)
    seen.clear()
    _assert_equal(ref, _pipelined(cfg, params, tokens, "data=2,stage=2,tensor=2", schedule,
                                  stage_layers=layers, remat_ratios=ratios, plan=plan,
                                  poison=True))
    assert {("oases", 2, "save_proj"), ("megatron", 1, "full")} <= set(seen), seen
    if ratios is None:
        assert set(seen) == {(s.schedule, s.sub_batches, s.remat) for s in plan}


def test_nan_bubbles_uneven_stages_and_stage_aware_remat(model):
    """Every receive buffer, residual pool and bubble transfer starts as NaN: nothing a
    correct plan reads. Uneven stages (2,3,1,2: padding rows) and Merak's ratios from r0=0.8
    (stages recompute 1, 2, 0, 0 of their layers) give the same numbers."""
    cfg, graphdef, params = model
    tokens = _tokens(cfg, 5)
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, "data=2,stage=4", "1f1b",
                             stage_layers=(2, 3, 1, 2), remat_ratios=(Fraction(4, 5),),
                             poison=True))


def test_interleaved_shared_pools(model):
    """Interleaved with two chunks a device on data=4,stage=2: the chunks share pools whose
    users keep different counts of leaves (the embedding's chunk, the head's), each user's
    slots at its own rows; NaN-filled buffers, uneven stages (2,6), each backward over two
    ticks."""
    cfg, graphdef, params = model
    tokens = _tokens(cfg, 4)
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, "data=4,stage=2", "interleaved",
                             stage_layers=(2, 6), poison=True, backward_ticks=2))


@pytest.mark.parametrize(("schedule", "ticks"), [("1f1b", 2), ("merak", 3)])
def test_backward_over_two_or_three_ticks(model, schedule, ticks):
    """A stage's backward split over two or three ticks (its layers in parts, the head in the
    last stage's top part; uneven stages 3,5) gives the same numbers as the one-device model
    (the other tests run one tick)."""
    cfg, graphdef, params = model
    tokens = _tokens(cfg, 3)
    pipe = ps.pipeline_spec(cfg, PipelineConfig(schedule=schedule, stage_layers=(3, 5),
                                                backward_ticks=ticks),
                            stages=2, microbatches=3)
    assert tuple(map(len, ps.backward_parts(cfg, pipe))) == (ticks, ticks)
    parts = {kind for kind, _ in ps.step_plan(cfg, pipe).branches if kind.startswith("B")}
    assert parts == ({"B"} if ticks == 1 else {f"B{i}" for i in range(ticks)})
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, "data=2,stage=2,tensor=2", schedule,
                             stage_layers=(3, 5), backward_ticks=ticks))


SPLIT_HEAD = [  # (mesh, schedule, M, stage layers, --fused-ticks)
    ("data=2,stage=4", "1f1b", "S+1", (2, 3, 1, 2), None),  # unfused
    ("data=2,stage=2,tensor=2", "1f1b", "S+1", None, True),
    ("data=2,stage=2,tensor=2", "merak", "2S+3", None, True),  # two forwards a tick
    pytest.param("data=4,stage=2", "interleaved", "S", None, True, marks=pytest.mark.slow),
    pytest.param("data=2,stage=4", "gpipe", "S", None, True, marks=pytest.mark.slow),
    pytest.param("stage=8", "gpipe", "S", None, None, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("mesh", "schedule", "m", "layers", "fused"), SPLIT_HEAD)
def test_split_head(model, mesh, schedule, m, layers, fused):
    """`--split-head on`: the head runs on every stage, each over 1/S of the positions, after
    the tick of the last stage's forward, and its input's gradient waits in the last stage's
    receive buffer for the backward, which runs in a later tick (fused tables too). The same
    numbers as one device (uneven stages, tensor parallelism, two chunks a device, eight
    stages, fused and unfused tables), with NaN-filled bubbles and buffers; one head a
    micro-batch."""
    cfg, graphdef, params = model
    S = _stages(mesh)
    pipe = ps.pipeline_spec(cfg, PipelineConfig(schedule=schedule, stage_layers=layers,
                                                split_head=True, fused_ticks=fused),
                            stages=S, microbatches=_m(m, S))
    plan = ps.step_plan(cfg, pipe)
    assert plan.head and pipe.fused() == (fused is True)  # unfused unless asked
    heads = plan.rows[:, 0, ps.executor.HEAD_MB]
    assert sorted(heads[heads >= 0]) == list(range(_m(m, S)))  # one head a micro-batch
    # No tick runs the last virtual stage's forward and backward of one micro-batch.
    chunk = (plan.virtual - 1) // S
    for rows in plan.table.tick_rows():
        done = {(a.kind, a.mb) for r in rows for a in [r[S - 1]]
                if a.kind != "IDLE" and a.chunk == chunk}
        assert not any(("F", mb) in done and ("B", mb) in done for _, mb in done), done
    tokens = _tokens(cfg, _m(m, S))
    _assert_equal(_reference(cfg, graphdef, params, tokens),
                  _pipelined(cfg, params, tokens, mesh, schedule, stage_layers=layers,
                             poison=True, split_head=True, fused_ticks=fused))


def test_layout_round_trip(model):
    cfg, _, params = model
    pipe = ps.pipeline_spec(cfg, PipelineConfig(schedule="interleaved", stage_layers=(2, 6),
                                                virtual_stages=2),
                            stages=2, microbatches=4)
    assert pipe.virtual_layers() == (1, 3, 1, 3) and pipe.lmax == 3
    back = ps.from_stages(ps.to_stages(params, pipe), pipe)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back), strict=True):
        np.testing.assert_array_equal(a, b)
