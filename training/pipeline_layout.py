"""A pipeline resolved against a model and a mesh (`PipelineSpec`) and its parameter layout:
each stacked block parameter [L, ...] stored as [S, v, Lmax, ...], sharded on `stage` (device
s, chunk c holds virtual stage c*S + s, whose n_j layers are the first n_j of its Lmax rows;
uneven stages leave zero padding rows that no stage reads). Checkpoints hold the standard
[L, ...] layout, so a run resumes onto any stage count. The train step is
`training.pipeline_step` (the tick executor's) or `training.pipeline_spmd` (`gpipe_spmd`);
both take the model's graphdefs and shifted tokens from here."""

from __future__ import annotations

import dataclasses
import functools
import math
from fractions import Fraction

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.errors import UserError
from oases_jax.models.config import ModelConfig
from oases_jax.models.transformer import Transformer
from oases_jax.pipeline import events
from oases_jax.pipeline import registry as pipelines
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.pipeline.remat import resolve_stage_layers
from oases_jax.pipeline.table import Schedule
from oases_jax.rules import ShardingRules, outer_axes, spec_divides
from oases_jax.stacks import Parallel, use_parallel

STAGE = "stage"


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineSpec:
    """A pipeline resolved against a model and a mesh: the settings it came from (`config`),
    S stages (the mesh's `stage` size), M micro-batches, v chunks per stage (interleaved),
    per-device layer counts and per-stage recompute ratios. Built by `of`."""

    config: PipelineConfig
    stages: int
    microbatches: int
    layers: tuple[int, ...]  # per device, summing to the model's layers
    chunks: int = 1
    ratios: tuple[Fraction, ...] | None = None  # stage-aware remat; None: none

    @classmethod
    def of(cls, config: PipelineConfig, *, stages: int, microbatches: int,
           num_layers: int) -> PipelineSpec:
        """`config` on S stages with M micro-batches over `num_layers` layers, checked (one-line
        UserErrors naming the value and the fix): the schedule runs, its M/S/v checks, the
        stages' layers and ratios."""
        spec = pipelines.runnable(config.schedule)
        chunks = spec.table(stages, microbatches, chunks=config.virtual_stages).chunks
        layers = resolve_stage_layers(config.stage_layers, num_layers, stages, chunks)
        if spec.equal_stages and len(set(layers)) > 1:
            raise UserError(f"--pipeline {spec.name} runs one program on every stage: the "
                            f"model's {num_layers} layers do not split into {stages} equal "
                            f"stages; use a stage count dividing them, or --pipeline "
                            f"{spec.ticked}")
        return cls(config=config, stages=stages, microbatches=microbatches, layers=layers,
                   chunks=chunks, ratios=config.ratios_for(stages))

    @property
    def schedule(self) -> str:
        return self.config.schedule

    @property
    def backward_ticks(self) -> int:
        """Ticks a backward spans; 0: the schedule's default (`backward_parts`)."""
        return self.config.backward_ticks

    @property
    def split_head(self) -> bool:
        """The head (final norm, logits, loss) split over every stage by positions, run after
        the tick of the last stage's forward (`executor.HeadProgram`); False (and always on one
        stage): the last stage's own."""
        return self.config.split_head and self.stages > 1

    def fused(self) -> bool:
        """Whether the executor runs the fused tick table: as set, else when it is the faster
        in lockstep (`events.fused_by_default`) and the head is the last stage's; never with a
        backward split over ticks. A split head keeps the last stage's backward out of its
        forward's tick, which leaves fused 1F1B one action a tick from S=4 and slower than the
        last stage's head at S=2, and its fused interleaved program compiled with the residual
        pools transposed every tick (GPT-2 1.5B, stage=2,data=8 on h100:16: 415.3 ms against
        196.8 unfused), so it runs fused only when asked (`--fused-ticks on`)."""
        if self.backward_ticks > 1:
            return False
        if self.config.fused_ticks is not None:
            return self.config.fused_ticks
        return not self.split_head and events.fused_by_default(self.schedule_table())

    @property
    def virtual(self) -> int:
        return self.stages * self.chunks

    def virtual_layers(self) -> tuple[int, ...]:
        """n_j, layers of virtual stage j = c*S + s: device s's count split into v chunks."""
        return tuple(self.layers[j % self.stages] // self.chunks for j in range(self.virtual))

    def starts(self) -> tuple[int, ...]:
        n = self.virtual_layers()
        return tuple(sum(n[:j]) for j in range(self.virtual))

    @property
    def lmax(self) -> int:
        return max(self.virtual_layers())

    def recomputed(self) -> tuple[int, ...]:
        """Per virtual stage, its first layers recomputed in the backward (stage-aware remat;
        a chunk recomputes its device's ratio of its own layers); 0 on a stage the schedule
        recomputes whole (`whole`), whose R already rebuilds every residual."""
        if self.ratios is None:
            return (0,) * self.virtual
        n, whole = self.virtual_layers(), self.whole()
        return tuple(0 if whole[j] else math.floor(n[j] * self.ratios[j % self.stages])
                     for j in range(self.virtual))

    def whole(self) -> tuple[bool, ...]:
        """Per virtual stage, whether the schedule recomputes it whole (`Schedule.whole`): its
        layers run without checkpoints, which would recompute them a second time."""
        return self.schedule_table().whole()

    def schedule_table(self) -> Schedule:
        return pipelines.get(self.schedule).table(self.stages, self.microbatches,
                                                  chunks=self.chunks)

    def index(self) -> tuple[np.ndarray, np.ndarray]:
        """(layer index [S, v, Lmax], valid mask [S, v, Lmax]) of the stage layout."""
        S, v, lmax = self.stages, self.chunks, self.lmax
        idx = np.zeros((S, v, lmax), np.int32)
        mask = np.zeros((S, v, lmax), bool)
        for j, (start, n) in enumerate(zip(self.starts(), self.virtual_layers(), strict=True)):
            s, c = j % S, j // S
            idx[s, c, :n] = np.arange(start, start + n)
            mask[s, c, :n] = True
        return idx, mask


# --- Layout: standard [L, ...] <-> stage [S, v, Lmax, ...] --------------------------------------


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def _stacked(var: nnx.Variable) -> bool:
    names = tuple(var.get_metadata().get("out_sharding") or ())
    return bool(names) and names[0] == "layers"


def to_stages(tree, pipe: PipelineSpec):
    """Every stacked block Variable in `tree` (parameters or a train state) to the stage
    layout, padding rows zero."""
    idx, mask = pipe.index()

    def one(var):
        if not (_is_var(var) and _stacked(var)):
            return var
        a = var.get_value()
        m = jnp.asarray(mask).reshape(mask.shape + (1,) * (a.ndim - 1))
        return var.replace(jnp.where(m, a[jnp.asarray(idx)], jnp.zeros((), a.dtype)))

    return jax.tree.map(one, tree, is_leaf=_is_var)


def from_stages(tree, pipe: PipelineSpec):
    """The inverse of `to_stages`."""
    idx, mask = pipe.index()
    where = [np.argwhere((idx == layer) & mask)[0] for layer in range(sum(pipe.layers))]
    s, c, i = (jnp.asarray([w[k] for w in where]) for k in range(3))

    def one(var):
        if not (_is_var(var) and _stacked(var)):
            return var
        return var.replace(var.get_value()[s, c, i])

    return jax.tree.map(one, tree, is_leaf=_is_var)


def stage_shardings(tree, rules: ShardingRules, mesh: Mesh):
    """NamedShardings of a stage-layout tree: block leaves split on `stage` (then as the rules
    say), everything else as the rules say (replicated over `stage`)."""

    def one(path, var):
        names = tuple(var.get_metadata().get("out_sharding") or ())
        if _stacked(var):
            spec = P(STAGE, None, None, *rules.param_spec(names[1:], mesh))
            names = (STAGE, "chunk", "layers") + names[1:]
        else:
            spec = rules.param_spec(names, mesh)
        shape = var.get_value().shape
        bad = spec_divides(shape, spec, mesh)
        if bad is not None:
            axes = spec[bad] if isinstance(spec[bad], tuple) else (spec[bad],)
            sizes = ",".join(f"{a}={mesh.shape[a]}" for a in axes)
            raise UserError(f"parameter {jax.tree_util.keystr(path)} dim {bad} ({names[bad]}="
                            f"{shape[bad]}) is not divisible by mesh axis {sizes} under rules "
                            f"{rules.name!r}; pick a mesh size that divides {shape[bad]}")
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=_is_var)


@functools.lru_cache(maxsize=16)
def _graphdefs(cfg: ModelConfig):
    """The graphdefs of the stacked blocks and of the final norm, and the head's matmul work
    in blocks (built outside any mesh: `pipeline_spec` calls this first)."""
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    block = sum(math.prod(a.shape[1:]) for a in jax.tree.leaves(nnx.state(model.blocks))
                if a.ndim >= 3)
    head = cfg.d_model * cfg.vocab_size / max(block, 1.0)
    return nnx.split(model.blocks)[0], nnx.split(model.norm_f)[0], head


def shifted(batch_MBL: jax.Array) -> jax.Array:
    """[M, B, L+1] token ids -> [M, B, 2, L]: each micro-batch's inputs and labels, shifted here,
    outside the tick loop. Shifted inside a branch, a sequence-sharded layout (sequence
    parallelism over `tensor`) made GSPMD shift the ids with halo collective-permutes inside
    the tick's switch, which the devices of stages running another branch never join: the CPU
    runtime's rendezvous deadlocks (collective-permutes rendezvous over every device)."""
    return jnp.stack([batch_MBL[..., :-1], batch_MBL[..., 1:]], axis=2)


def over_stages(parallel: Parallel, params, batch_MBL, groups: int, stage_grads):
    """(mean loss, mean gradients) of a batch of M micro-batches in the stage layout, with
    `stage_grads(local_params, tokens_M2BL) -> (loss summed over micro-batches, float32
    gradients of local_params)` run on each device inside a `shard_map` manual over `stage`
    (and `data` when gradient accumulation keeps the data groups apart): the shifted tokens,
    this device's blocks, then the embedding/head gradients and the loss summed over `stage`
    (each stage holds its own part, zeros elsewhere) and over `data`. Both executors run
    through here (`pipeline_step.pipeline_grads`, `pipeline_spmd.spmd_pipeline_grads`)."""
    manual = {STAGE} | ({"data"} if groups > 1 else set())
    p_specs = jax.tree.map(lambda var: P(STAGE) if _stacked(var) else P(), params,
                           is_leaf=_is_var)
    batch_spec = P(None, "data") if groups > 1 else P()

    def local(params_in, tokens):
        params = dict(params_in)
        params["blocks"] = jax.tree.map(lambda a: a[0], params["blocks"])
        with outer_axes(*manual), use_parallel(parallel):
            loss, acc = stage_grads(params, shifted(tokens))
        acc["blocks"] = jax.tree.map(lambda a: a[None], acc["blocks"])
        shared = {k: v for k, v in acc.items() if k != "blocks"}
        acc.update(jax.lax.psum(shared, STAGE))
        loss = jax.lax.psum(loss, STAGE)
        if groups > 1:
            loss, acc = jax.lax.psum((loss, acc), "data")
        # Back to the parameters' own tree type (State and Variable nodes), key by key.
        leaves = [leaf for key in params for leaf in jax.tree.leaves(acc[key])]
        return loss, jax.tree.unflatten(jax.tree.structure(params_in), leaves)

    loss, grads = jax.shard_map(local, mesh=parallel.mesh, in_specs=(p_specs, batch_spec),
                                out_specs=(P(), p_specs), axis_names=manual,
                                check_vma=False)(params, batch_MBL)
    scale = 1.0 / (batch_MBL.shape[0] * groups)
    return loss * scale, jax.tree.map(lambda g: g * scale, grads)
