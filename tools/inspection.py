"""Compile one train step (or one transformer layer, forward and backward) for a target, and
report what the compiled program does: collectives, overlap, memory, FLOPs, simulated time."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import ModelConfig
from models.layers import Block
from models.sharding import param_shardings
from models.transformer import FAMILY_NORM, remat_policy
from oases_jax.analysis.program import Analysis, Program, analyze
from oases_jax.analysis.simulate import SimResult, simulate
from oases_jax.analysis.targets import Target
from oases_jax.analysis.xla_estimate import XlaEstimate, compile_with_estimate
from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec
from oases_jax.mesh import make_mesh
from oases_jax.rules import constrain, get_rules, use_rules
from oases_jax.tensor_parallel import TensorParallel, use_tensor_parallel
from training.checks import check_shapes
from training.config import SCHEDULES, OptimConfig, ParallelConfig
from training.optim import make_optimizer
from training.state import build_step_fns

# Schedules whose GPU compile can abort inside XLA: compiled in a child process.
MAY_ABORT = ("xla_auto",)

# XLA options per schedule on GPU targets (see docs/parallelism.md, "GPU compile settings").
_GPU_BASE = {"xla_gpu_enable_latency_hiding_scheduler": True}
GPU_OPTIONS: dict[str, dict] = {
    "megatron": _GPU_BASE,
    "megatron_sp": _GPU_BASE,
    # Two permutes in flight at once: a backward ring step moves a block and a partial sum.
    # The dot merger would fuse GEMMs that share an operand (a ring step's two chunks, two
    # sub-batches' projections) into one, which then waits for both inputs' collectives.
    "collective_matmul": {**_GPU_BASE, "xla_gpu_experimental_parallel_collective_overlap_limit": 2,
                          "xla_disable_hlo_passes": "dot-merger"},
    # Keep each sub-batch's collective separate: XLA's combiners would merge them into one.
    "oases": {**_GPU_BASE, "xla_gpu_all_reduce_combine_threshold_bytes": 0,
              "xla_gpu_all_gather_combine_threshold_bytes": 0,
              "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
              "xla_disable_hlo_passes": "dot-merger"},
    # Three in flight: a bidirectional backward ring step moves four halves (two of the block,
    # two of the partial sum); with 2, two of them had no GEMM on `small` (share 0.80).
    "oases_cm": {**_GPU_BASE, "xla_gpu_experimental_parallel_collective_overlap_limit": 3,
                 "xla_gpu_collective_permute_combine_threshold_bytes": 0,
                 "xla_disable_hlo_passes": "dot-merger"},
    # A primepar backward step has three permutes in flight (two blocks and a partial sum); the
    # combiner would merge a step's weight shifts into one synchronous permute.
    "primepar": {**_GPU_BASE, "xla_gpu_experimental_parallel_collective_overlap_limit": 3,
                 "xla_gpu_collective_permute_combine_threshold_bytes": 0},
    # A threshold of 0 MiB makes XLA's windowed-einsum pass abort (a cycle found by the algebraic
    # simplifier) on the attention einsums of jax 0.12.0.1; 1 MiB still rewrites every projection.
    "xla_auto": {**_GPU_BASE, "xla_gpu_threshold_for_windowed_einsum_mib": 1,
                 "xla_gpu_multi_streamed_windowed_einsum": True},
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class CompileSpec:
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
        if self.layer and self.parallel.layers:
            raise UserError("per-layer strategies describe a whole train step, not one layer; "
                            "drop --layer")


@dataclasses.dataclass
class Inspection:
    spec: CompileSpec
    target: Target
    analysis: Analysis
    program: Program
    sim: SimResult
    compile_s: float
    mesh: str  # resolved, e.g. data=1,tensor=8
    xla: XlaEstimate | None = None  # XLA's own estimate (GPU targets only)

    def report(self) -> dict:
        a, sim, par = self.analysis, self.sim, self.spec.parallel
        return {
            "target": self.target.name,
            "cluster": self.target.cluster.name,
            "model": dataclasses.asdict(self.spec.model),
            "mesh": self.mesh,
            "rules": self.spec.parallel.rules_name,
            "schedule": "plan" if par.layers else par.schedule,
            # A plan's per-layer strategies; None when every layer runs `schedule`.
            "layers": [dataclasses.asdict(s) for s in par.layers] if par.layers else None,
            "layer": self.spec.layer,
            "batch_size": self.spec.batch_size,
            "microbatches": self.spec.microbatches,
            "seq_len": self.spec.seq_len,
            "collectives": [c.to_json() for c in a.collectives],
            "collective_counts": a.counts_by_kind(),
            "collective_bytes": a.collective_bytes(),
            "overlap_share": a.overlap_share(),
            "gemm_overlap_share": a.overlap_share(require="gemm"),
            "gemm_overlap_share_by_kind": {
                kind: a.overlap_share(require="gemm", kinds=[kind])
                for kind in sorted(a.counts_by_kind())},
            "peak_memory_bytes": a.peak_memory_bytes,
            "memory": a.memory,
            "flops": a.flops,
            "op_counts": a.op_counts,
            "simulated_step_s": sim.step_s,
            "compute_s": sim.compute_s,
            "comm_s": sim.comm_s,
            "exposed_comm_s": sim.exposed_comm_s,
            "compile_s": self.compile_s,
            "xla_estimate": self.xla.to_json() if self.xla else None,
        }


def compiler_options(schedules: str | Sequence[str], target: Target) -> dict:
    """XLA options for the schedules one program runs (a plan mixes them per layer): the union
    of each schedule's `GPU_OPTIONS`, where they differ the value that serves them all (the most
    collectives in flight, the lowest combine or windowed-einsum threshold). Options are
    per-program, so a megatron layer beside an oases one also loses the combiners; disabled
    passes are the union of the lists."""
    if not target.is_gpu_aot:
        return {}
    out: dict = {}
    for schedule in [schedules] if isinstance(schedules, str) else schedules:
        for key, value in GPU_OPTIONS.get(schedule, _GPU_BASE).items():
            if key not in out:
                out[key] = value
            elif key == "xla_disable_hlo_passes":  # comma-separated pass names: their union
                names = out[key].split(",") + [n for n in value.split(",")
                                                if n not in out[key].split(",")]
                out[key] = ",".join(names)
            elif key.endswith("_limit") or isinstance(value, bool):
                out[key] = max(out[key], value)
            else:
                out[key] = min(out[key], value)
    return out


def _abstract(tree, shardings):
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def lower_train_step(spec: CompileSpec, mesh):
    par = spec.parallel
    rules = get_rules(par.rules_name)
    check_shapes(batch_size=spec.batch_size, microbatches=spec.microbatches,
                 seq_len=spec.seq_len, mesh=mesh, sub_batches=par.layer_sub_batches,
                 rules=get_rules("tp_sp") if par.sequence_parallel else rules)
    tx = make_optimizer(OptimConfig(), total_steps=1000)
    fns = build_step_fns(spec.model, tx, rules, mesh, spec.parallel.schedule,
                         spec.parallel.sub_batches, layers=spec.parallel.layers)
    m = spec.microbatches
    batch = jax.ShapeDtypeStruct((m, spec.batch_size // m, spec.seq_len + 1), jnp.int32,
                                 sharding=fns.batch_sharding)
    with jax.set_mesh(mesh):
        return fns.step_jit.lower(fns.abstract_state, batch)


def lower_layer(spec: CompileSpec, mesh):
    """Forward and backward of one block: sum(block(x)) and its gradients w.r.t. params and x
    (the value keeps the forward alive, as a train step does)."""
    cfg, rules = spec.model, get_rules(spec.parallel.rules_name)
    block = nnx.eval_shape(lambda: Block(cfg, FAMILY_NORM[cfg.family], rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(block)
    p_sh = param_shardings(params, rules, mesh)
    x_sh = NamedSharding(mesh, rules.act_spec(("batch", "seq", "embed"), mesh))
    x = jax.ShapeDtypeStruct((spec.batch_size, spec.seq_len, cfg.d_model),
                             jnp.dtype(cfg.dtype), sharding=x_sh)

    tp = TensorParallel(spec.parallel.schedule, rules, mesh,
                        sub_batches=spec.parallel.sub_batches)

    def fwd_bwd(p, x_BLD):
        with use_rules(rules, mesh), use_tensor_parallel(tp):
            def f(p, x):
                y = nnx.merge(graphdef, p)(constrain(x, ("batch", "seq", "embed")))
                return jnp.sum(y.astype(jnp.float32))

            policy = remat_policy(cfg.remat, tp.uses_rings)
            if policy is not None:
                f = jax.checkpoint(f, policy=policy)
            return jax.value_and_grad(f, argnums=(0, 1))(p, x_BLD)

    with jax.set_mesh(mesh):
        out_sh = (NamedSharding(mesh, P()), (p_sh, x_sh))
        return jax.jit(fwd_bwd, out_shardings=out_sh).lower(_abstract(params, p_sh), x)


def spec_to_json(spec: CompileSpec) -> dict:
    return {"model": dataclasses.asdict(spec.model), "parallel": dataclasses.asdict(spec.parallel),
            "batch_size": spec.batch_size, "seq_len": spec.seq_len,
            "microbatches": spec.microbatches, "layer": spec.layer}


def spec_from_json(d: dict) -> CompileSpec:
    par = dict(d["parallel"])
    if par.get("layers") is not None:
        par["layers"] = tuple(LayerSpec(**s) for s in par["layers"])
    return CompileSpec(model=ModelConfig(**d["model"]), parallel=ParallelConfig(**par),
                       batch_size=d["batch_size"], seq_len=d["seq_len"],
                       microbatches=d.get("microbatches", 1), layer=d["layer"])


def inspect_isolated(spec: CompileSpec, target: str, timeline: str | None = None,
                     timeout_s: int = 900) -> dict:
    """`inspect_program` in a child process, returning its report. XLA aborts the whole process
    on some graphs (see `GPU_OPTIONS`); here that becomes a report with an `error`."""
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = pathlib.Path(tmp, "spec.json"), pathlib.Path(tmp, "report.json")
        spec_path.write_text(json.dumps(spec_to_json(spec)))
        cmd = [sys.executable, "-m", "tools.inspection", str(spec_path), target, str(out_path),
               timeline or ""]
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if proc.returncode == 0 and out_path.exists():
            return json.loads(out_path.read_text())
    reason = next((ln for ln in proc.stderr.splitlines() if "Check failed" in ln or "rror" in ln),
                  f"exit code {proc.returncode}")
    return {"schedule": "plan" if spec.parallel.layers else spec.parallel.schedule,
            "target": target,
            "error": f"XLA aborted the compile: {reason.strip()[:300]}"}


def inspect_program(spec: CompileSpec, target: Target) -> Inspection:
    for schedule in spec.parallel.schedules:
        if schedule not in SCHEDULES:
            raise ValueError(schedule)
    mesh = make_mesh(spec.parallel.mesh, target.devices)
    t0 = time.perf_counter()
    lowered = lower_layer(spec, mesh) if spec.layer else lower_train_step(spec, mesh)
    options = compiler_options(spec.parallel.schedules, target)
    xla = None
    if target.is_gpu_aot:  # the same compile also dumps XLA's schedule and its time estimates
        compiled, xla = compile_with_estimate(lowered, options)
    else:
        compiled = lowered.compile(compiler_options=options)
    compile_s = time.perf_counter() - t0
    analysis, program = analyze(compiled, mesh)
    axes = zip(mesh.axis_names, mesh.devices.shape, strict=True)
    resolved = ",".join(f"{n}={s}" for n, s in axes)
    sim = simulate(program, target.cluster)
    return Inspection(spec, target, analysis, program, sim, compile_s, resolved, xla)


if __name__ == "__main__":  # the child of `inspect_isolated`
    from oases_jax.analysis.targets import get_target

    spec_file, target_name, out_file, timeline_file = sys.argv[1:5]
    ins = inspect_program(spec_from_json(json.loads(pathlib.Path(spec_file).read_text())),
                          get_target(target_name))
    pathlib.Path(out_file).write_text(json.dumps(ins.report()))
    if timeline_file:
        from tools.report import draw_timeline

        draw_timeline(ins.sim.events, ins.report(), timeline_file)
