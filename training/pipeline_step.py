"""The pipelined train step: the transformer split into contiguous stages on the `stage` mesh
axis and run by `oases_jax.pipeline.executor` under a schedule (docs/parallelism.md,
"Pipeline parallelism").

Parameter layout: each stacked block parameter [L, ...] is stored as [S, v, Lmax, ...], sharded
on `stage` (device s, chunk c holds virtual stage c*S + s, whose n_j layers are the first n_j
of its Lmax rows; uneven stages leave zero padding rows that no stage reads, whose gradients
and AdamW updates are zero). Embedding, final norm and head are replicated over `stage`; only
the first stage (embedding) and the last (norm, head, loss; the embedding again when tied) use
them, and their gradients are summed over `stage` once per step. Checkpoints hold the standard
[L, ...] layout (`layout_fns`), so a run resumes onto any stage count. The settings and the
layout conversions are in `training.pipeline_layout`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.errors import UserError
from oases_jax.models.config import ModelConfig
from oases_jax.models.layers import block_fns, compute_weights
from oases_jax.models.sharding import abstract_model
from oases_jax.models.transformer import Transformer, cross_entropy
from oases_jax.pipeline import executor
from oases_jax.pipeline import registry as pipelines
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.rules import ShardingRules
from oases_jax.stacks import Parallel, run_stack, use_parallel
from oases_jax.stacks import active as active_parallel
from oases_jax.training import pipeline_spmd
from oases_jax.training.pipeline_head import split_head
from oases_jax.training.pipeline_layout import (
    STAGE,
    PipelineSpec,
    _graphdefs,
    _is_var,
    _stacked,
    from_stages,
    over_stages,
    stage_shardings,
    to_stages,
)

__all__ = ["STAGE", "PipelineSpec", "backward_parts", "build_pipeline_step_fns", "from_stages",
           "layout", "pipeline_grads", "pipeline_spec", "spec_for", "stage_program",
           "stage_shardings", "step_plan", "to_stages"]


def pipeline_spec(cfg: ModelConfig, config: PipelineConfig, *, stages: int,
                  microbatches: int) -> PipelineSpec:
    """`config` resolved against the model on S stages with M micro-batches (`PipelineSpec.of`;
    one-line UserErrors naming the value and the fix)."""
    if cfg.moe:
        raise UserError("--pipeline does not run MoE models yet; drop --pipeline or use a dense "
                        "model")
    pipe = PipelineSpec.of(config, stages=stages, microbatches=microbatches,
                           num_layers=cfg.n_layers)
    _graphdefs(cfg)
    return pipe


# --- The stage program of the transformer -------------------------------------------------------


# The key of the head's vocabulary table (tied: the embedding's) in the compute dtype, made once
# per step by `stage_program`'s `prepare`; its gradient goes to the float32 parameter.
HEAD_TABLE = "head_table"
# Recomputed share of a layer's forward inside its backward, per remat policy: chooses how many
# ticks a backward spans (`backward_parts`), nothing else.
_RECOMPUTE_SHARE = {"none": 0.0, "full": 1.0, "save_proj": 0.5, "save_dots": 0.1}


def _head_weight(cfg: ModelConfig) -> float:
    """The head's forward work in layers: its matmul against one block's matmuls."""
    return _graphdefs(cfg)[2]


def backward_parts(cfg: ModelConfig, pipe: PipelineSpec
                   ) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Per virtual stage, the contiguous parts its backward runs as, one tick each: (first,
    end) over the stage's items (its layers, then the head on the last stage). A backward
    that costs k forwards (k = 2, plus what remat recomputes in it) spans k ticks, so every
    tick of the lockstep program holds about one forward's work; the parts balance the
    backward's cost (a recomputed layer's backward costs 3, another's 2, the head's twice its
    weight). `pipe.backward_ticks` sets k for every stage; by default every schedule runs the
    whole backward in one tick (docs/parallelism.md "Time": the compiled programs' B is near
    F). A stage never has more parts than items."""
    V = pipe.virtual
    n_j, k_j, whole = pipe.virtual_layers(), pipe.recomputed(), pipe.whole()
    head = _head_weight(cfg)
    out = []
    for j in range(V):
        share = 0.0 if whole[j] else _RECOMPUTE_SHARE.get(cfg.remat, 0.0)
        bwd = [2.0 + (1.0 if i < k_j[j] else share) for i in range(n_j[j])]
        bwd += [2.0 * head] if j == V - 1 and not pipe.split_head else []
        k = max(1, min(len(bwd), pipe.backward_ticks or 1))
        out.append(_balanced(bwd, k))
    return tuple(out)


def _balanced(costs: list[float], k: int) -> tuple[tuple[int, int], ...]:
    """Split `costs` into k non-empty contiguous parts minimising the largest part (exact DP)."""
    n = len(costs)
    pre = [0.0]
    for c in costs:
        pre.append(pre[-1] + c)
    best = {(0, 0): (0.0, ())}
    for parts in range(1, k + 1):
        for end in range(parts, n - (k - parts) + 1):
            cands = []
            for start in range(parts - 1, end):
                if (parts - 1, start) in best:
                    worst, cuts = best[(parts - 1, start)]
                    cands.append((max(worst, pre[end] - pre[start]), (*cuts, (start, end))))
            best[(parts, end)] = min(cands)
    return best[(k, n)][1]


def step_plan(cfg: ModelConfig, pipe: PipelineSpec) -> executor.Plan:
    """The executor plan the pipelined step runs (what the analysis of its program reads)."""
    return executor.plan(pipe.schedule_table(), tuple(map(len, backward_parts(cfg, pipe))),
                         fuse=pipe.fused(), head=pipe.split_head)


def stage_program(cfg: ModelConfig, pipe: PipelineSpec, act: jax.ShapeDtypeStruct
                  ) -> executor.StageProgram:
    """The transformer's program for the tick executor (`executor.StageProgram`): each part
    of a virtual stage runs its share of the stage's layers (`backward_parts`); stage 0's
    first part embeds the tokens first, and the last stage's last part ends in the final
    norm, head and loss unless the head is split off (`split_head`)."""
    gd_blocks, gd_norm, _ = _graphdefs(cfg)
    tables = _StageTables(pipe.stages, pipe.virtual_layers(), pipe.recomputed(), pipe.whole(),
                          backward_parts(cfg, pipe), pipe.starts(), cfg.learned_positions)
    return executor.StageProgram(
        forward=_forward(cfg, tables, gd_blocks, gd_norm), params=_params(tables),
        add_grads=_add_grads(cfg, tables), act=act, parts=tuple(len(p) for p in tables.parts),
        prepare=_prepare(cfg, act),
        head=split_head(cfg, pipe, act.shape[1], HEAD_TABLE) if pipe.split_head else None)


class _StageTables(NamedTuple):
    """What `stage_program`'s parts run, per virtual stage j: its layer count, how many of
    them (the first) it recomputes, whether its schedule recomputes it whole, its backward
    parts (`backward_parts`) and its first layer in the model; and whether the embedding has
    a `pos` table."""

    S: int
    n_j: tuple[int, ...]
    k_j: tuple[int, ...]
    whole: tuple[bool, ...]
    parts: tuple[tuple[tuple[int, int], ...], ...]
    starts: tuple[int, ...]
    learned_positions: bool

    def layers(self, j, q):
        """[lo, hi) of the stage's layers part q runs, and whether it ends with the head."""
        first, end = self.parts[j][q]
        return min(first, self.n_j[j]), min(end, self.n_j[j]), end > self.n_j[j]

    def shared(self, j, q):
        keys = []
        if j == 0 and q == 0:
            keys += ["embed"] + (["pos"] if self.learned_positions else [])
        if self.layers(j, q)[2]:
            keys += ["norm_f", HEAD_TABLE]
        return tuple(dict.fromkeys(keys))

    def ranges(self, j, q):
        """The part's layer ranges: (key, first, end) of its recomputed layers (below the
        stage's k) and of the rest, empty ones left out."""
        lo, hi, _ = self.layers(j, q)
        k = self.k_j[j]
        return tuple((key, a, b) for key, a, b in (("remat", lo, min(hi, k)),
                                                    ("keep", max(lo, k), hi)) if a < b)


def _prepare(cfg: ModelConfig, act: jax.ShapeDtypeStruct):
    dt = jnp.dtype(cfg.dtype)
    head_key = "embed" if cfg.tied else "head"

    def prepare(local):
        """Once per step, outside the tick loop: each chunk's block weights in the compute
        dtype (one copy; a cast inside a branch re-ran every tick, a full pass over the stage's
        weights each: 1.3 ms of a 17 ms GPT-2 1.5B forward tick on h100:16), and so the
        head's vocabulary table (`HEAD_TABLE`): the last stage's forward and backward ticks
        had each cast the float32 table, and its backward converted the gradient before adding
        it (GPT-2 1.5B, stage=4,data=4 on h100:16: 0.24 ms of an 8.5 ms forward tick). The
        embedding's lookup keeps the float32 table, so its scatter-added gradient stays
        float32."""
        def chunks(a):
            cast = a.ndim >= 4 and jnp.issubdtype(a.dtype, jnp.floating)
            return tuple(a[c].astype(dt) if cast else a[c] for c in range(a.shape[0]))
        out = {"blocks": jax.tree.map(chunks, local["blocks"]),
               **{k: v for k, v in local.items() if k != "blocks"}}
        if head_key in out:
            out[HEAD_TABLE] = compute_weights(out[head_key], dt, lead=0)
        if "pos" in out:
            # The L rows the embedding adds, taken here: under sequence parallelism the table
            # is sharded over `tensor` by rows, and slicing them inside a branch moved rows with
            # collective-permutes there (see `shifted`). `add_grads` adds their gradient back
            # into the table's first L rows.
            out["pos"] = jax.tree.map(lambda a: a[:act.shape[1]], out["pos"])
        return out
    return prepare


def _params(tables: _StageTables):
    def params(j, q):
        c = j // tables.S

        def pick(prepared):
            # Block weights enter the VJP already sliced to each range and in the compute dtype:
            # the backward keeps them as its own primal (never a per-micro-batch copy, as a
            # slice taken inside the VJP would be); the cast's transpose is the same cast of the
            # gradient, so the gradients are those of the float32 weights. A range that spans
            # the whole chunk is the prepared array itself (JAX returns a full slice as is).
            return {"blocks": {key: jax.tree.map(lambda a, f=first, e=end: a[c][f:e],
                                                 prepared["blocks"],
                                                 is_leaf=lambda x: isinstance(x, tuple))
                               for key, first, end in tables.ranges(j, q)},
                    "shared": {k: prepared[k] for k in tables.shared(j, q)}}
        return pick
    return params


def _add_grads(cfg: ModelConfig, tables: _StageTables):
    head_key = "embed" if cfg.tied else "head"

    def add_grads(j, q):
        c = j // tables.S

        def add(acc, g):
            acc = dict(acc)
            for key, first, end in tables.ranges(j, q):
                acc["blocks"] = jax.tree.map(
                    lambda a, b, f=first, e=end: a.at[c, f:e].add(b.astype(a.dtype)),
                    acc["blocks"], g["blocks"][key])
            for key, v in g["shared"].items():
                # `pos` arrives as its first L rows (`prepare`); the head's table is its
                # parameter's compute-dtype copy.
                k = head_key if key == HEAD_TABLE else key
                acc[k] = jax.tree.map(lambda a, b: a.at[:b.shape[0]].add(b.astype(a.dtype))
                                      if a.shape != b.shape else a + b.astype(a.dtype),
                                      acc[k], v)
            return acc
        return add
    return add_grads


def _forward(cfg: ModelConfig, tables: _StageTables, gd_blocks, gd_norm):
    head_key = "embed" if cfg.tied else "head"

    def forward(j, q):
        with_head = tables.layers(j, q)[2]

        def f(pj, x, pair_B2L):
            # [B, 2, L]: the inputs and the labels, shifted outside the tick loop (`shifted`).
            sh = pj["shared"]
            # The model's own methods on a stand-in holding only what this part uses.
            stand_in = types.SimpleNamespace(cfg=cfg, **{key: sh[key] for key in (
                "embed", "pos", "head") if key in sh})
            if j == 0 and q == 0:
                x = Transformer.embed_tokens(stand_in, pair_B2L[:, 0])
            fns = block_fns(gd_blocks)
            # Layers below k are recomputed in the backward (stage-aware remat); a stage the
            # schedule recomputes whole keeps every residual (its R is the recompute).
            for key, first, end in tables.ranges(j, q):
                remat = "none" if tables.whole[j] else "full" if key == "remat" else None
                with _layer_plan(tables.starts[j] + first, end - first, remat):
                    x = run_stack(fns, pj["blocks"][key], x, scan=cfg.scan_layers,
                                  remat_default=remat or cfg.remat)
            if with_head:
                h = nnx.merge(gd_norm, sh["norm_f"])(x)
                head_in = types.SimpleNamespace(cfg=cfg, **{head_key: sh[HEAD_TABLE]})
                logits = Transformer.logits(head_in, h, None)
                return cross_entropy(logits, pair_B2L[:, 1], cfg.vocab_size)
            return x
        return f
    return forward


@contextlib.contextmanager
def _layer_plan(first: int, n: int, remat: str | None):
    """Under a per-layer plan (`Parallel.layers`), the active parallel narrowed to the model's
    layers [first, first + n), which one range of a stage runs; `remat` ("full": the range the
    stage-aware ratios recompute; "none": a stage its schedule recomputes whole) overrides each
    layer's own policy. Without one, nothing changes (the range runs the default strategy under
    `remat_default`)."""
    parallel = active_parallel()
    if parallel is None or parallel.layers is None:
        yield
        return
    specs = parallel.layers[first:first + n]
    if remat is not None:
        specs = tuple(dataclasses.replace(s, remat=remat) for s in specs)
    with use_parallel(dataclasses.replace(parallel, layers=tuple(specs))):
        yield


def pipeline_grads(cfg: ModelConfig, pipe: PipelineSpec, parallel: Parallel,
                   params, batch_MBL, groups: int, *, poison: bool = False):
    """(mean loss, mean gradients) of a batch of M micro-batches in the stage layout."""
    _, B, L1 = batch_MBL.shape
    act = jax.ShapeDtypeStruct((B // groups, L1 - 1, cfg.d_model), jnp.dtype(cfg.dtype))
    prog = stage_program(cfg, pipe, act)
    plan = step_plan(cfg, pipe)
    return over_stages(parallel, params, batch_MBL, groups, lambda p, tokens: executor.run(
        plan, prog, p, tokens, stage_axis=STAGE, poison=poison))


# --- The train step ------------------------------------------------------------------------------


def spec_for(cfg: ModelConfig, parallel_cfg, microbatches: int, mesh: Mesh | int
             ) -> PipelineSpec:
    """The pipeline a run asks for (`ParallelConfig.pipeline`) on `mesh` (or on that many
    stages)."""
    stages = mesh if isinstance(mesh, int) else mesh.shape.get(STAGE, 1)
    return pipeline_spec(cfg, parallel_cfg.pipeline, stages=stages, microbatches=microbatches)


# The executor of each pipeline schedule's record (`oases_jax.pipeline.registry.EXECUTORS`).
EXECUTORS = {"ticks": pipeline_grads, "spmd_gpipe": pipeline_spmd.spmd_pipeline_grads,
             "spmd_1f1b": pipeline_spmd.spmd_1f1b_grads}


def build_pipeline_step_fns(cfg: ModelConfig, tx: optax.GradientTransformation,
                            parallel: Parallel, pipe: PipelineSpec):
    """`training.state.build_step_fns` for a pipelined model: the same StepFns (train step,
    evaluation, optimizer init, shardings), over parameters in the stage layout."""
    from oases_jax.training.state import (
        _eval_loss,
        accumulation_groups,
        assemble_step_fns,
        loss_fn,
        optimizer_update,
    )

    rules, mesh = parallel.rules, parallel.mesh
    graphdef, abstract_std = abstract_model(cfg)
    abstract_params = jax.eval_shape(lambda p: to_stages(p, pipe), abstract_std)
    p_sh = stage_shardings(abstract_params, rules, mesh)
    groups = accumulation_groups(rules, mesh)
    batch_sh = NamedSharding(mesh, P(None, "data") if groups > 1 else P())

    grads_fn = EXECUTORS[pipelines.get(pipe.schedule).executor]

    def train_step(state, batch_MBL):
        loss, grads = grads_fn(cfg, pipe, parallel, state["params"], batch_MBL, groups)
        return optimizer_update(tx, state, grads, {"loss": loss})

    def evaluate(params, tokens):
        # Evaluation is rare: the standard layout (gathered over `stage`) and the plain model.
        return _eval_loss(*loss_fn(graphdef, from_stages(params, pipe), tokens[0],
                                   cfg.vocab_size))

    return assemble_step_fns(parallel, tx, abstract_params=abstract_params, p_sh=p_sh,
                             batch_sh=batch_sh, train_step=train_step, evaluate=evaluate)


def layout(pipe: PipelineSpec, fns, rules: ShardingRules, mesh: Mesh):
    """(to_stored, to_standard, restore_as) of a pipelined run: the train state to and from the
    standard layout checkpoints hold (jitted, onto the step's shardings), and the abstract
    standard-layout state a checkpoint is restored as (block leaves replicated over `stage`)."""
    def standard(var):
        if not (_is_var(var) and _stacked(var)):
            return var
        a = var.get_value()
        names = tuple(var.get_metadata().get("out_sharding") or ())
        shape = (sum(pipe.layers), *a.shape[3:])
        sh = NamedSharding(mesh, P(None, *rules.param_spec(names[1:], mesh)))
        return var.replace(jax.ShapeDtypeStruct(shape, a.dtype, sharding=sh))

    restore_as = jax.tree.map(standard, fns.abstract_state, is_leaf=_is_var)
    stored_sh = jax.tree.map(lambda a: a.sharding, fns.abstract_state)
    standard_sh = jax.tree.map(lambda a: a.sharding, restore_as)
    with jax.set_mesh(mesh):
        to_stored = jax.jit(lambda t: to_stages(t, pipe), out_shardings=stored_sh)
        to_standard = jax.jit(lambda t: from_stages(t, pipe), out_shardings=standard_sh)

    def params_to_stored(tree):
        """A params-only tree (fresh init) or a whole train state."""
        if isinstance(tree, dict) and "params" in tree:
            return to_stored(tree)
        return jax.jit(lambda t: to_stages(t, pipe), out_shardings=stored_sh["params"])(tree)

    return params_to_stored, to_standard, restore_as
