"""The per-stage account of a compiled pipelined train step (`oases_jax.analysis.
pipeline_stages`): which leaves each virtual stage's residual and stash slots hold, read the way
the executor lays them out, and the FLOPs and memory per stage that follow from the program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from models.sharding import abstract_model
from oases_jax.analysis import pipeline_stages
from oases_jax.analysis.pipeline_time import find_tick_loop
from oases_jax.analysis.program import Program
from oases_jax.pipeline import executor
from oases_jax.rules import get_rules, outer_axes
from oases_jax.stacks import Parallel, use_parallel
from training import pipeline_step
from training.pipeline_layout import STAGE, _is_var, _stacked, to_stages
from training.program import CompileSpec
from training.state import accumulation_groups


def step_plan(spec: CompileSpec, mesh: Mesh) -> tuple[executor.Plan, pipeline_step.PipelineSpec]:
    """The plan the pipelined step of `spec` runs (as `training.pipeline_step` builds it)."""
    pipe = pipeline_step.spec_for(spec.model, spec.parallel, spec.microbatches, mesh)
    if hasattr(pipeline_step, "step_plan"):
        return pipeline_step.step_plan(spec.model, pipe), pipe
    return executor.plan(pipe.schedule_table()), pipe


def stage_layouts(spec: CompileSpec, mesh: Mesh) -> tuple[dict, dict]:
    """(residuals, stashes): per virtual stage j, the (shape, dtype) of every leaf one
    micro-batch stores in its residual slot (the VJP's residuals other than the stage's own
    parameters, every part of a backward spread over several ticks) and in its stash slot (the
    stage input of a forward recomputed later; none on j = 0). Traced inside the same shard_map
    as the step, so the shapes are those each device holds."""
    cfg, par = spec.model, spec.parallel
    rules = get_rules(par.rules_name)
    parallel = Parallel(mesh, rules, par.default_layer, par.layers, moe=par.moe_setup)
    _, pipe = step_plan(spec, mesh)
    groups = accumulation_groups(rules, mesh)
    manual = {STAGE} | ({"data"} if groups > 1 else set())
    m = spec.microbatches
    act = jax.ShapeDtypeStruct((spec.batch_size // m // groups, spec.seq_len, cfg.d_model),
                               jnp.dtype(cfg.dtype))
    prog = pipeline_step.stage_program(cfg, pipe, act)
    parts = getattr(prog, "parts", None)
    _, abstract_std = abstract_model(cfg)
    params = jax.eval_shape(lambda p: to_stages(p, pipe), abstract_std)
    p_specs = jax.tree.map(lambda var: P(STAGE) if _stacked(var) else P(), params,
                           is_leaf=_is_var)
    tokens = jax.ShapeDtypeStruct((m, spec.batch_size // m, spec.seq_len + 1), jnp.int32)
    residuals: dict[int, list] = {}

    def fn(kind, j, q):
        f = getattr(prog, kind)
        return f(j, q) if parts is not None else f(j)

    def local(params_in, tokens_MBL):
        local_params = dict(params_in)
        local_params["blocks"] = jax.tree.map(lambda a: a[0], local_params["blocks"])
        with outer_axes(*manual), use_parallel(parallel):
            for j in range(pipe.virtual):
                leaves = []
                for q in range(parts[j] if parts is not None else 1):
                    params_jq = fn("params", j, q)(local_params)
                    forward = fn("forward", j, q)
                    if j == 0 and q == 0:
                        _, vjp_fn = jax.vjp(lambda pj, f=forward: f(pj, None, tokens_MBL[0]),
                                            params_jq)
                    else:
                        x = jnp.zeros(act.shape, act.dtype)
                        _, vjp_fn = jax.vjp(lambda pj, xx, f=forward: f(pj, xx, tokens_MBL[0]),
                                            params_jq, x)
                    stored, is_param, _ = executor._split_residuals(vjp_fn, params_jq)
                    leaves += [(tuple(a.shape), jnp.dtype(a.dtype).name)
                               for a, ip in zip(stored, is_param, strict=True) if not ip]
                residuals[j] = leaves
        return jnp.zeros((), jnp.float32)

    with jax.set_mesh(mesh):
        jax.eval_shape(jax.shard_map(local, mesh=mesh, in_specs=(p_specs, P(None, "data")
                                                                  if groups > 1 else P()),
                                     out_specs=P(), axis_names=manual, check_vma=False),
                       params, tokens)
    stash = (tuple(act.shape), jnp.dtype(act.dtype).name)
    stashes = {j: ([] if j == 0 else [stash]) for j in range(pipe.virtual)}
    return residuals, stashes


def stage_account(spec: CompileSpec, mesh: Mesh, program: Program, peak_bytes: int) -> dict:
    """Per-stage FLOPs and memory of the compiled pipelined step (`pipeline_stages`), as JSON."""
    plan, _ = step_plan(spec, mesh)
    loop = find_tick_loop(program, plan)
    if loop is None:
        return {"error": "no tick loop matching the plan found"}
    residuals, stashes = stage_layouts(spec, mesh)
    divisors = [size for name, size in mesh.shape.items() if name not in (STAGE, "data")]
    flops = pipeline_stages.stage_flops(program, plan, loop)
    memory = pipeline_stages.stage_memory(program, plan, residuals, stashes, peak_bytes, loop,
                                          divisors)
    ratios = pipeline_step.spec_for(spec.model, spec.parallel, spec.microbatches, mesh).ratios
    return {"flops": flops.to_json(), "memory": memory.to_json(),
            "remat_ratios": None if ratios is None else [float(r) for r in ratios],
            "unmatched_pools": len(memory.unmatched)}
