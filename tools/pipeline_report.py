"""The per-stage account of a compiled pipelined train step (`oases_jax.tools.analysis.
pipeline_stages`): which leaves each virtual stage's residual and stash slots hold, read the way
the executor lays them out, and the FLOPs and memory per stage that follow from the program."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from oases_jax.models.sharding import abstract_model
from oases_jax.pipeline import executor
from oases_jax.rules import get_rules, outer_axes
from oases_jax.stacks import Parallel, use_parallel
from oases_jax.tools.analysis import pipeline_stages
from oases_jax.tools.analysis.pipeline_time import find_tick_loop
from oases_jax.tools.analysis.program import Program
from oases_jax.training import pipeline_step
from oases_jax.training.pipeline_layout import STAGE, _is_var, _stacked, shifted, to_stages
from oases_jax.training.program import CompileSpec
from oases_jax.training.state import accumulation_groups


def step_plan(spec: CompileSpec, mesh: Mesh) -> tuple[executor.Plan, pipeline_step.PipelineSpec]:
    """The plan the pipelined step of `spec` runs (as `training.pipeline_step` builds it)."""
    pipe = pipeline_step.spec_for(spec.model, spec.parallel, spec.microbatches, mesh)
    return pipeline_step.step_plan(spec.model, pipe), pipe


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
    _, abstract_std = abstract_model(cfg)
    params = jax.eval_shape(lambda p: to_stages(p, pipe), abstract_std)
    p_specs = jax.tree.map(lambda var: P(STAGE) if _stacked(var) else P(), params,
                           is_leaf=_is_var)
    tokens = jax.ShapeDtypeStruct((m, spec.batch_size // m, spec.seq_len + 1), jnp.int32)
    residuals: dict[int, list] = {}

    def local(params_in, tokens_MBL):
        local_params = dict(params_in)
        local_params["blocks"] = jax.tree.map(lambda a: a[0], local_params["blocks"])
        data = shifted(tokens_MBL)[0]  # as `over_stages` feeds the executor
        with outer_axes(*manual), use_parallel(parallel):
            layouts = executor.residual_layouts(prog, local_params, data)
        for j in range(pipe.virtual):
            residuals[j] = [(tuple(a.shape), jnp.dtype(a.dtype).name)
                            for q in range(prog.parts[j]) for a in layouts[(j, q)]]
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
    memory = pipeline_stages.stage_memory(
        program, plan, residuals, stashes, peak_bytes, loop, divisors)
    ratios = pipeline_step.spec_for(spec.model, spec.parallel, spec.microbatches, mesh).ratios
    return {"flops": flops.to_json(), "memory": memory.to_json(),
            "remat_ratios": None if ratios is None else [float(r) for r in ratios],
            "unmatched_pools": len(memory.unmatched)}


def memory_rows(report: dict, *, variant: str, model: str) -> list[dict]:
    """One row per stage of an inspection report of a pipelined step: its recompute ratio and
    FLOPs share, residual bytes per micro-batch and slots, the bytes its slots hold, and its
    peak (XLA's whole-program peak - the pools + what it holds)."""
    p = report["pipeline"]
    st = p["per_stage"]
    f, m = st["flops"], st["memory"]
    ratios = st.get("remat_ratios") or [0.0] * p["stages"]
    held = m["held_bytes"]
    rows = []
    for s in range(p["stages"]):
        virtual = range(s, len(m["residual_bytes"]), p["stages"])
        rows.append({
            "model": model, "target": report["target"], "mesh": report["mesh"],
            "variant": variant, "remat": report["model"]["remat"], "stage": s,
            "ratio": ratios[s], "recompute_over_forward": f["recompute_ratio"][s],
            "residual_bytes": sum(m["residual_bytes"][j] for j in virtual),
            "res_slots": [m["res_slots"][j] for j in virtual],
            "stash_slots": [m["stash_slots"][j] for j in virtual],
            "held_bytes": held[s], "stage_peak_bytes": m["stage_peak_bytes"][s],
            "held_max_over_min": max(held) / min(held) if min(held) else None,
            "pool_bytes": m["pool_bytes"], "peak_bytes": m["peak_bytes"],
            "unmatched_pools": st["unmatched_pools"]})
    return rows


def memory_text(rows: list[dict]) -> str:
    """`memory_rows` as an aligned table, MiB."""
    mib = 2**20
    head = (f"{'variant':<34} {'stage':>5} {'r_i':>5} {'recomp/fwd':>10} {'res/mb':>8} "
            f"{'slots':>6} {'held':>8} {'stage peak':>10} | {'held max/min':>12} "
            f"{'pools':>8} {'XLA peak':>9}")
    lines = [head]
    for r in rows:
        even = f"{r['held_max_over_min']:12.2f}" if r["held_max_over_min"] else f"{'-':>12}"
        slots = "/".join(f"{a}+{b}" for a, b in zip(r["res_slots"], r["stash_slots"],
                                                     strict=True))
        tail = (f" | {even} {r['pool_bytes'] / mib:8.1f} {r['peak_bytes'] / mib:9.1f}"
                if r["stage"] == 0 else "")
        lines.append(f"{r['variant'][:34]:<34} {r['stage']:5d} {r['ratio']:5.2f} "
                     f"{r['recompute_over_forward']:10.1%} {r['residual_bytes'] / mib:8.2f} "
                     f"{slots:>6} {r['held_bytes'] / mib:8.1f} "
                     f"{r['stage_peak_bytes'] / mib:10.1f}{tail}")
    lines.append("MiB per device; res/mb: residual bytes of one micro-batch; slots: residual + "
                 "stash slots; held = slots' bytes; stage peak = XLA peak - pools + held")
    return "\n".join(lines)


def shares(report: dict) -> dict:
    """A pipelined report's step split the way the issue asks, each as a share of our
    simulated step (outside the loop + every tick): bubble = the stages' mean wait inside the
    ticks (for the slowest stage's branch), exposed communication (the permutes every tick plus
    what the slowest branches leave exposed), recompute = the stages' mean time in R branches
    plus the recomputing share of their backward branches (by FLOPs: `pipeline_stages`)."""
    p = report["pipeline"]
    f = p["per_stage"]["flops"]
    cost = [b["step_s"] for b in p["branches"]]
    kinds = [pipeline_stages.base_kind(b["kind"]) for b in p["branches"]]
    S, step = p["stages"], p["step_s"]
    rec = []
    for s in range(S):
        cells = [lane[s][0] for tick in p["rows"] for lane in tick]  # every lane of every tick
        r_time = sum(cost[b] for b in cells if kinds[b] == "R")
        b_time = sum(cost[b] for b in cells if kinds[b] == "B")
        in_b = f["recompute_b"][s] / f["backward"][s] if f["backward"][s] else 0.0
        rec.append(r_time + b_time * max(in_b, 0.0))
    idle = [p["switch_s"] - b for b in p["busy_s"]]
    return {"step_s": step, "bubble": sum(idle) / S / step,
            "exposed_comm": p["exposed_comm_s"] / step, "recompute": sum(rec) / S / step,
            "idle_per_stage": [i / step for i in idle]}


def schedules_table(reports: list[dict]) -> str:
    """Pipeline schedules of the same program side by side: our simulator's step tick by tick
    and XLA's estimate (GPU targets), each with its ratio to the first, and the step's shares."""
    ms, gib = 1e3, 2**30
    first = reports[0]
    head = (f"{'schedule':<12} {'ticks':>5} {'our step ms':>11} {'ratio':>6} {'XLA step ms':>11} "
            f"{'ratio':>6} {'bubble':>7} {'exp comm':>8} {'recomp':>7} {'event ms':>9} "
            f"{'peak GiB':>8}  idle per stage")
    lines = [head]
    x0 = (first.get("xla_estimate") or {}).get("step_s")
    for r in reports:
        x = (r.get("xla_estimate") or {}).get("step_s")
        xla = f"{x * ms:11.1f} {x / x0:6.2f}" if x and x0 else f"{'-':>11} {'-':>6}"
        if r["pipeline"] is None:  # gpipe_spmd, 1f1b_spmd: no tick switch, the whole program
            step = r["simulated_step_s"]
            lines.append(
                f"{r['pipeline_schedule']:<12} {'-':>5} {step * ms:11.1f} "
                f"{step / _step(first):6.2f} {xla} {'-':>7} "
                f"{r['exposed_comm_s'] / step:8.1%} {'-':>7} {'-':>9} "
                f"{r['peak_memory_bytes'] / gib:8.2f}  -")
            continue
        p, sh = r["pipeline"], shares(r)
        idle = ", ".join(f"{i:.1%}" for i in sh["idle_per_stage"])
        lines.append(
            f"{p['schedule']:<12} {str(p['ticks']) + ('f' if p.get('lanes', 1) > 1 else ''):>5} "
            f"{p['step_s'] * ms:11.1f} "
            f"{p['step_s'] / _step(first):6.2f} {xla} {sh['bubble']:7.1%} "
            f"{sh['exposed_comm']:8.1%} {sh['recompute']:7.1%} "
            f"{p['events']['makespan_s'] * ms + p['outside_s'] * ms:9.1f} "
            f"{r['peak_memory_bytes'] / gib:8.2f}  {idle}")
    lines.append("ticks: 10f = 10 fused ticks (a stage runs a run of its actions, one a lane); "
                 "our step: outside the tick loop + every tick (its slowest stage's branches + the "
                 "permutes); event: the event simulator with the same branch costs (stages run "
                 "ahead) + outside; bubble, exposed comm and recompute: shares of our step "
                 "(gpipe_spmd, 1f1b_spmd, no tick switch: the whole program's simulated step)")
    return "\n".join(lines)


def _step(report: dict) -> float:
    """A pipelined report's step: tick by tick, or (the SPMD pipelines) the whole program's."""
    return report["pipeline"]["step_s"] if report["pipeline"] else report["simulated_step_s"]
