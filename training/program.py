"""The one compile path: lower and compile the train step (or one layer's forward and backward)
that a parallel config describes, for a mesh of real devices or of a deviceless GPU target.

`training.train`, `tools.bench`, `tools.inspection` (and through it `scripts/inspect_hlo.py` and
the planner's checks) all compile here, so the program that trains is the program that is
inspected: same lowering, same XLA options (`registry.compiler_options` for the schedules the
layers run, on the mesh's platform).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax import registry
from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.models.layers import Block, block_fns, compute_weights
from oases_jax.models.sharding import param_shardings
from oases_jax.models.transformer import FAMILY_NORM
from oases_jax.moe import schedules as moe_schedules
from oases_jax.moe.stack import scan_schedules
from oases_jax.pipeline import pools
from oases_jax.pipeline import registry as pipelines
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.rules import constrain, get_rules
from oases_jax.stacks import Parallel, run_layer, use_parallel
from oases_jax.training import pipeline_step
from oases_jax.training.checks import check_shapes
from oases_jax.training.config import OptimConfig, ParallelConfig
from oases_jax.training.optim import make_optimizer
from oases_jax.training.state import StepFns, build_step_fns


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileSpec:
    """What to compile: a model under a parallel config, at a batch shape."""

    model: ModelConfig
    parallel: ParallelConfig  # with `layers`, a plan's per-layer strategies
    batch_size: int = 8  # global, per optimizer step
    seq_len: int = 1024
    microbatches: int = 1  # accumulated micro-batches of batch_size / microbatches rows
    layer: bool = False  # one block's forward + backward instead of a whole train step

    def __post_init__(self):
        if self.microbatches < 1 or self.batch_size % self.microbatches:
            raise UserError(f"batch {self.batch_size} does not split into {self.microbatches} "
                            "micro-batches; use a divisor of the batch")
        if self.seq_len > self.model.max_seq_len:
            raise UserError(f"--seq-len {self.seq_len} exceeds the model's max_seq_len "
                            f"{self.model.max_seq_len}; shorten it or raise max_seq_len "
                            "(--model-set max_seq_len=N)")
        if self.layer and self.parallel.layers:
            raise UserError("per-layer strategies describe a whole train step, not one layer; "
                            "drop --layer")

    def to_json(self) -> dict:
        pipe = self.parallel.pipeline
        par = {**dataclasses.asdict(self.parallel),
               "pipeline": None if pipe is None else pipe.to_json()}
        return {"model": dataclasses.asdict(self.model), "parallel": par,
                "batch_size": self.batch_size, "seq_len": self.seq_len,
                "microbatches": self.microbatches, "layer": self.layer}

    @classmethod
    def from_json(cls, d: dict) -> CompileSpec:
        par = dict(d["parallel"])
        if par.get("layers") is not None:
            par["layers"] = tuple(LayerSpec(**s) for s in par["layers"])
        if par.get("pipeline") is not None:
            par["pipeline"] = PipelineConfig(**par["pipeline"])
        return cls(model=ModelConfig(**d["model"]), parallel=ParallelConfig(**par),
                   batch_size=d["batch_size"], seq_len=d["seq_len"],
                   microbatches=d.get("microbatches", 1), layer=d["layer"])


def platform_of(mesh: Mesh) -> str:
    """"gpu" for real and deviceless GPUs alike, else the devices' platform."""
    return mesh.devices.flat[0].platform


def compiler_options(parallel: ParallelConfig, mesh: Mesh) -> dict:
    """The XLA options the schedules of `parallel` need on the mesh's platform (an MoE run's
    MoE schedule's too: those of parm_s2 wherever `auto` may choose it; a pipeline run by the
    tick executor, `pools.compiler_options`)."""
    out = registry.compiler_options(parallel.schedules, platform_of(mesh))
    if parallel.pipeline and pipelines.get(parallel.pipeline.schedule).executor == "ticks":
        out = registry.merge_options(out, pools.compiler_options(platform_of(mesh)))
    if platform_of(mesh) in ("gpu", "cuda", "rocm"):
        name = parallel.moe_schedule
        extra = moe_schedules.get("parm_s2" if name == "auto" else name).gpu_options
        out = registry.merge_options(out, extra)
    return out


def check_moe(model: ModelConfig, par: ParallelConfig, mesh: Mesh) -> None:
    """An MoE model's flags against the mesh, before anything is traced: experts divisible by
    the expert axis, a rule set and schedule MoE layers run under. A dense model with an
    explicit --moe-schedule is refused (it would be ignored)."""
    if not model.moe:
        if par.moe_schedule != "auto" or par.moe_chunks:
            raise UserError(f"--moe-schedule {par.moe_schedule} / --moe-chunks need an MoE model "
                            "(n_experts set, e.g. --model small-moe); drop them")
        return
    ep = dict(mesh.shape).get("expert", 1)
    if model.n_experts % ep:
        raise UserError(f"n_experts={model.n_experts} does not split over mesh axis expert={ep}; "
                        f"use a number of experts divisible by {ep} or a smaller expert axis")
    if par.rules_name not in ("dp", "tp", "tp_sp"):
        raise UserError(f"MoE models run under --rules dp, tp or tp_sp, not {par.rules_name}; "
                        "the experts are split over expert and tensor, never over data")
    if par.layers is not None:
        raise UserError("per-layer plans do not cover MoE models yet; run an MoE model with "
                        "--schedule and --moe-schedule instead of --plan")
    if par.schedule not in scan_schedules():
        raise UserError(f"--schedule {par.schedule} runs its layers inside one shard_map, which "
                        f"MoE layers do not join yet; use one of {', '.join(scan_schedules())}")


# The XLA option naming a scheduling profile (`ProfiledInstructionsProto`): XLA's GPU scheduler
# then orders the program by the profile's costs (`tools.analysis.schedule_profile` writes one
# from our simulator; `train.py --schedule-profile`).
SCHEDULE_PROFILE_OPTION = "xla_gpu_pgle_profile_file_or_directory_path"


def schedule_profile_options(path: str | None) -> dict:
    """The compile options that order a program by the scheduling profile at `path` (none)."""
    return {SCHEDULE_PROFILE_OPTION: str(path)} if path else {}


def check_schedule_profile(path: str) -> None:
    """`--schedule-profile FILE` (train.py, inspect_hlo.py): a regular file that exists, checked
    before the compile that reads it."""
    from oases_jax.files import regular_file

    regular_file(path, "--schedule-profile",
                 "write one with inspect_hlo.py --write-schedule-profile OUT")


@dataclasses.dataclass
class StepProgram:
    """A lowered program and the options it compiles with. `fns` holds the train step's
    shardings and companions (None for a layer program)."""

    spec: CompileSpec
    mesh: Mesh
    lowered: jax.stages.Lowered
    options: dict
    fns: StepFns | None = None

    def compile(self, extra_options: dict | None = None) -> jax.stages.Compiled:
        """Compile with the schedules' options (plus `extra_options`, e.g. a schedule dump)."""
        return self.lowered.compile(compiler_options={**self.options, **(extra_options or {})})

    @property
    def resolved_mesh(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.mesh.axis_names, self.mesh.devices.shape,
                                                   strict=True))


def lower(spec: CompileSpec, mesh: Mesh, tx: optax.GradientTransformation | None = None
          ) -> StepProgram:
    """Lower `spec` on `mesh`. `tx` is the optimizer of a training run (default: AdamW with
    the default settings, for inspection)."""
    par = spec.parallel
    rules = get_rules(par.rules_name)
    check_shapes(batch_size=spec.batch_size, microbatches=spec.microbatches,
                 seq_len=spec.seq_len, mesh=mesh, sub_batches=par.layer_sub_batches,
                 rules=get_rules("tp_sp") if par.sequence_parallel else rules)
    options = compiler_options(par, mesh)
    if spec.layer and spec.model.moe:
        raise UserError("--layer compiles one dense block; an MoE model's layer program is not "
                        "built yet: compile its train step (drop --layer)")
    if spec.layer:
        return StepProgram(spec, mesh, _lower_layer(spec, mesh), options)
    tx = tx or make_optimizer(OptimConfig(), total_steps=1000)
    check_moe(spec.model, par, mesh)
    parallel = Parallel(mesh, rules, par.default_layer, par.layers, moe=par.moe_setup)
    if (par.pipeline and pipelines.get(par.pipeline.schedule).executor == "spmd_gpipe"
            and "primepar" in par.schedules
            and platform_of(mesh) == "cpu"):
        # XLA:CPU starts some of this program's independent collectives in a different order
        # on different devices (seen: an all-reduce over tp_col on some, a collective-permute
        # on the others), and its in-process rendezvous then waits forever; ordering the
        # head's backward before the loop's did not help. 1f1b_spmd runs.
        raise UserError("--pipeline gpipe_spmd with --schedule primepar deadlocks XLA:CPU's "
                        "collectives; on CPU devices use --pipeline 1f1b_spmd (gpipe_spmd "
                        "compiles for GPU targets)")
    if par.pipeline:  # the stages' own step (training.pipeline_step), same StepFns
        pipe = pipeline_step.spec_for(spec.model, par, spec.microbatches, mesh)
        fns = pipeline_step.build_pipeline_step_fns(spec.model, tx, parallel, pipe)
    else:
        fns = build_step_fns(spec.model, tx, parallel)
    m = spec.microbatches
    batch = jax.ShapeDtypeStruct((m, spec.batch_size // m, spec.seq_len + 1), jnp.int32,
                                 sharding=fns.batch_sharding)
    with jax.set_mesh(mesh):
        lowered = fns.step_jit.lower(fns.abstract_state, batch)
    return StepProgram(spec, mesh, lowered, options, fns)


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _lower_layer(spec: CompileSpec, mesh: Mesh) -> jax.stages.Lowered:
    """Forward and backward of one block, run by the runtime as in a train step:
    sum(block(x)^2) / 2 and its gradients w.r.t. params and x. The output's gradient is the
    output itself: like a stack's, it depends on the forward (an input would let the backward
    start before the forward ends) and is no constant (which would let XLA fold the collectives
    it passes through); the value keeps the forward alive."""
    cfg, par = spec.model, spec.parallel
    rules = get_rules(par.rules_name)
    block = nnx.eval_shape(lambda: Block(cfg, FAMILY_NORM[cfg.family], rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(block)
    p_sh = param_shardings(params, rules, mesh)
    x_sh = NamedSharding(mesh, rules.act_spec(("batch", "seq", "embed"), mesh))
    x = jax.ShapeDtypeStruct((spec.batch_size, spec.seq_len, cfg.d_model),
                             jnp.dtype(cfg.dtype), sharding=x_sh)
    parallel = Parallel(mesh, rules, dataclasses.replace(par.default_layer, remat=cfg.remat))
    seg = parallel.segment(parallel.default)
    fns = block_fns(graphdef)

    def fwd_bwd(p, x_BLD):
        with use_parallel(parallel):
            def f(p, x):
                y = run_layer(seg, fns, p, constrain(x, ("batch", "seq", "embed")))
                return jnp.sum(jnp.square(y.astype(jnp.float32))) / 2

            def loss(p, x):  # weights cast once, outside the layer's remat, as in a step
                return seg.wrap(f, in_scan=False)(compute_weights(p, cfg.dtype, lead=0), x)

            return jax.value_and_grad(loss, argnums=(0, 1))(p, x_BLD)

    with jax.set_mesh(mesh):
        out_sh = (NamedSharding(mesh, P()), (p_sh, x_sh))
        return jax.jit(fwd_bwd, out_shardings=out_sh).lower(_abstract(params, p_sh), x)
