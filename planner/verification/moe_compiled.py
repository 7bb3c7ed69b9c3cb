"""The MoE sweep checked against compiled programs: for a deterministic subset of the sweep's
layers, every schedule `auto` weighs (and ds_moe) is compiled without a GPU as the MoE layer's
forward and backward, timed by our simulator of the compiled program (`analysis.simulate`), and
`auto`'s pick is set beside the best (`scripts/moe_sweep.py --compiled`; docs/parallelism.md,
"Mixture of experts").

The layer program is the MoE feed-forward a GPT-2 MoE model trains with (`models.moe.MoEFFN`:
router, experts with biases, the runtime's `moe_layer` under the schedule), its weights cast to
bf16 once as in a train step, on the residual stream's sharding: the gradients of sum((x + y)^2)
/ 2 + the router losses for the parameters and the input, compiled with the options training
gives the schedule (`training.program.compiler_options`). XLA compiles here for H100s only, so the
32-GPU cluster of V100 nodes is compiled for 32 H100 devices and timed with its own devices and
links, as the alpha-beta model prices it.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from oases_jax.errors import UserError
from oases_jax.hardware import get_cluster
from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.models.layers import compute_weights
from oases_jax.models.moe import MoEFFN
from oases_jax.models.sharding import param_shardings
from oases_jax.moe import MoESetup, use_moe
from oases_jax.moe import cost as cost
from oases_jax.moe import schedules as moe_schedules
from oases_jax.planner.cost.moe_cost import CLUSTERS, GRID, hardware
from oases_jax.rules import get_rules
from oases_jax.targets import get_target
from oases_jax.tools.analysis.program import analyze_text
from oases_jax.tools.analysis.simulate import Simulator
from oases_jax.training.config import ParallelConfig
from oases_jax.training.program import compiler_options

# Where each sweep cluster's programs compile: nodes of H100s (XLA's GPU compiler without a
# GPU), with the cluster's own numbers for the simulator.
COMPILE_TARGETS = {"h100-8": "h100:8", "v100-32": "h100:32", "cpu-8": "local"}
SEQ = 1024  # positions per sequence (at most): a (data, expert) shard holds tokens / SEQ
WITHIN = 1.05  # `auto` counts as right when its program is within 5% of the best


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """One MoE layer of the sweep on one cluster (`tokens`: per (data, expert) shard)."""

    cluster: str
    ep: int
    mp: int
    experts: int
    hidden: int
    tokens: int
    top_k: int
    capacity_factor: float

    def shape(self, dtype_bytes: int = 2) -> cost.LayerShape:
        return cost.LayerShape(tokens=self.tokens, d_model=self.hidden, d_ff=4 * self.hidden,
                               experts=self.experts, top_k=self.top_k,
                               capacity_factor=self.capacity_factor, dtype_bytes=dtype_bytes,
                               ep=self.ep, mp=self.mp, bias=True)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def subset(n: int, clusters=CLUSTERS, grid=GRID) -> list[Config]:
    """`n` layers per cluster, the same on every cluster, spread over the grid: layer j takes
    level j mod 3 of E, (j + j//3) mod 3 of hidden, (j + 2(j//3) + j//9) mod 3 of tokens (each
    (E, hidden), (E, tokens) and (hidden, tokens) pair once per 9 layers) and the (top-k,
    capacity factor) pair j mod 4 (each (E, top-k, f) once per 12 layers)."""
    if not 1 <= n <= math.prod(len(v) for v in grid.values()):
        raise UserError(f"--compiled {n}: compile 1 to 108 layers per cluster (the grid's size)")
    picks, seen = [], set()
    for j in itertools.count():
        if len(picks) == n:
            break
        key = (grid["experts"][j % 3], grid["hidden"][(j + j // 3) % 3],
               grid["tokens"][(j + 2 * (j // 3) + j // 9) % 3], grid["top_k"][j % 2],
               grid["capacity_factor"][j % 4 // 2])
        if key not in seen:
            seen.add(key)
            picks.append(key)
    return [Config(cluster=name, ep=ep, mp=mp, experts=e, hidden=d, tokens=t, top_k=k,
                   capacity_factor=f)
            for name, ep, mp in clusters for e, d, t, k, f in picks]


def candidates(shape: cost.LayerShape) -> list[tuple[str, int, int]]:
    """(schedule, forward chunks, backward chunks) of ds_moe, parm_s1 and parm_s2 with each
    chunk count `auto` weighs (the same count both ways) up to the slots per expert."""
    top = cost.slots(shape, "parm_s1")
    return [("ds_moe", 1, 1), ("parm_s1", 1, 1)] + [
        ("parm_s2", r, r) for r in cost.CHUNKS if 1 < r <= top]


def label(schedule: str, chunks: int, backward_chunks: int) -> str:
    return cost.Estimate(schedule, chunks, 0.0, 0.0, (), backward_chunks).label


def lower_layer(c: Config, schedule: str, chunks: int, backward_chunks: int, mesh):
    """The MoE layer program of `c` under one schedule on `mesh`: (lowered, options)."""
    # the gpt2-moe-h{hidden}-e{E} preset (any hidden that is a multiple of 64)
    cfg = get_preset("gpt2-moe-h768-e8").replace(
        d_model=c.hidden, n_heads=c.hidden // 64, n_experts=c.experts, dtype="bfloat16",
        top_k=c.top_k, capacity_factor=c.capacity_factor)
    seq = min(SEQ, c.tokens)
    mesh_text = f"expert={c.ep},tensor={c.mp}"
    rules = get_rules("tp")
    ffn = nnx.eval_shape(lambda: MoEFFN(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(ffn)
    p_sh = param_shardings(params, rules, mesh)
    x_sh = NamedSharding(mesh, rules.act_spec(("batch", "seq", "embed"), mesh))
    x = jax.ShapeDtypeStruct((c.ep * c.tokens // seq, seq, cfg.d_model), jnp.bfloat16,
                             sharding=x_sh)
    setup = MoESetup(schedule=schedule, chunks=chunks, backward_chunks=backward_chunks)

    def fwd_bwd(p, x_BLD):
        def loss(p, x):
            y, aux = nnx.merge(graphdef, compute_weights(p, cfg.dtype, lead=0))(x)
            # the residual stream, as an MoE block leaves it (S1/S2 give the MP ranks their
            # tokens back here: an all-gather, and another for the gradient)
            out = jax.lax.with_sharding_constraint(x + y.astype(x.dtype), x_sh)
            return (jnp.sum(jnp.square(out.astype(jnp.float32))) / 2
                    + cfg.router_aux_weight * aux["aux_loss"] + cfg.router_z_weight * aux["z_loss"])

        with use_moe(setup, rules, mesh):
            return jax.grad(loss, argnums=(0, 1))(p, x_BLD)

    abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            params, p_sh)
    with jax.set_mesh(mesh):
        lowered = jax.jit(fwd_bwd, out_shardings=(p_sh, x_sh)).lower(abstract, x)
    par = ParallelConfig(mesh=mesh_text, rules="tp", schedule="megatron", moe_schedule=schedule,
                         moe_chunks=chunks if moe_schedules.get(schedule).chunked else 0)
    return lowered, compiler_options(par, mesh)


def compile_layer(c: Config, schedule: str, chunks: int, backward_chunks: int
                  ) -> tuple[str, tuple, float]:
    """One schedule's layer program compiled for the cluster's target: (scheduled HLO text,
    mesh axes, seconds to lower and compile)."""
    target = get_target(COMPILE_TARGETS[c.cluster])
    mesh = make_mesh(f"expert={c.ep},tensor={c.mp}", target.devices)
    t0 = time.perf_counter()
    lowered, options = lower_layer(c, schedule, chunks, backward_chunks, mesh)
    text = lowered.compile(compiler_options=options).as_text()
    return text, tuple(zip(mesh.axis_names, mesh.devices.shape, strict=True)), \
        time.perf_counter() - t0


def simulate_layer(c: Config, text: str, mesh_axes: tuple) -> dict:
    """A compiled layer program replayed by the simulator on the cluster's devices and links:
    {step_s, compute_s, comm_s, exposed_comm_s, comm_by_kind_s}."""
    _, program = analyze_text(text, mesh_axes)
    sim = Simulator(program, get_cluster(c.cluster))
    result = sim.run()
    by_kind: dict[str, float] = {}
    for ev in result.events:
        if ev.stream == "comm":
            by_kind[ev.kind] = by_kind.get(ev.kind, 0.0) + ev.end - ev.start
    return {**result.to_json(), "comm_by_kind_s": by_kind}


def time_layer(c: Config, schedule: str, chunks: int, backward_chunks: int) -> dict:
    """Compile one schedule's layer program and simulate it (`simulate_layer`, + compile_s)."""
    text, axes, compile_s = compile_layer(c, schedule, chunks, backward_chunks)
    return {**simulate_layer(c, text, axes), "compile_s": compile_s}


def validate(configs: list[Config], log: Callable[[str], None] = lambda s: None,
             timer: Callable[..., dict] = time_layer) -> list[dict]:
    """One row per layer: every candidate's simulated time and the model's, the best, auto's
    pick (`moe_cost.choose` on the cluster's links, as the sweep picks) and its time over the
    best. Programs are compiled once per run (`timer` is cached by its arguments)."""
    cache: dict[tuple, dict] = {}
    rows = []
    for n, c in enumerate(configs, 1):
        shape, hw = c.shape(), hardware(get_cluster(c.cluster), c.ep, c.mp)
        auto = cost.choose(shape, hw)
        picks = candidates(shape)
        if (auto.schedule, auto.chunks, auto.backward_chunks) not in picks:
            picks.append((auto.schedule, auto.chunks, auto.backward_chunks))
        sim, model = {}, {}
        for sched, rf, rb in picks:
            key = (c, sched, rf, rb)
            if key not in cache:
                cache[key] = timer(c, sched, rf, rb)
            name = label(sched, rf, rb)
            sim[name] = cache[key]
            model[name] = cost.estimate(shape, hw, sched, rf, rb).total_s
        best = min(sim, key=lambda k: sim[k]["step_s"])
        auto_name = auto.label
        row = {**c.to_json(), "simulated": sim, "model_s": model, "best": best,
               "best_s": sim[best]["step_s"], "auto": auto_name,
               "auto_s": sim[auto_name]["step_s"],
               "auto_over_best": sim[auto_name]["step_s"] / sim[best]["step_s"],
               "speedup": sim["ds_moe"]["step_s"] / sim[auto_name]["step_s"],
               "best_speedup": sim["ds_moe"]["step_s"] / sim[best]["step_s"],
               "model_best": min(model, key=model.get)}
        rows.append(row)
        log(f"[{n}/{len(configs)}] {_config_text(row)}: best {best} "
            f"{row['best_s'] * 1e3:.3f} ms, auto {auto_name} x{row['auto_over_best']:.3f}")
    return rows


def summary(rows: list[dict]) -> dict:
    """Overall and per cluster: layers, the share where auto is within 5% of the best, auto's
    time over the best (max), and min / median / max speedup over ds_moe of auto and of the
    best, all under the simulator of the compiled programs."""
    def one(sel):
        within = [r["auto_over_best"] <= WITHIN for r in sel]
        return {"layers": len(sel), "within_5pct": sum(within) / len(sel),
                "auto_over_best_max": max(r["auto_over_best"] for r in sel),
                "auto_speedup": _mmm([r["speedup"] for r in sel]),
                "best_speedup": _mmm([r["best_speedup"] for r in sel]),
                "model_picks_best": sum(r["model_best"] == r["best"] for r in sel) / len(sel)}

    out = {"all": one(rows)}
    for name in dict.fromkeys(r["cluster"] for r in rows):
        out[name] = one([r for r in rows if r["cluster"] == name])
    return out


def _mmm(xs) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def _config_text(r: dict) -> str:
    return (f"{r['cluster']} E={r['experts']} h={r['hidden']} T={r['tokens']} k={r['top_k']} "
            f"f={r['capacity_factor']:g}")


def markdown(rows: list[dict]) -> str:
    """Per layer: each schedule's simulated ms, the best, auto's pick and its ratio; then the
    summary."""
    names = list(dict.fromkeys(k for r in rows for k in r["simulated"]))
    lines = ["| layer | " + " | ".join(names) + " | best | auto | auto / best |",
             "|---|" + "---|" * (len(names) + 3)]
    for r in rows:
        cells = [f"{r['simulated'][k]['step_s'] * 1e3:.3f}" if k in r["simulated"] else "-"
                 for k in names]
        lines.append(f"| {_config_text(r)} | " + " | ".join(cells)
                     + f" | {r['best']} | {r['auto']} | {r['auto_over_best']:.3f} |")
    lines += ["", "| cluster | layers | auto within 5% of best | auto / best max | "
              "auto / ds_moe min / median / max | best / ds_moe min / median / max | "
              "model's best = compiled best |", "|---|---|---|---|---|---|---|"]
    for name, s in summary(rows).items():
        a, b = s["auto_speedup"], s["best_speedup"]
        lines.append(f"| {name} | {s['layers']} | {s['within_5pct']:.0%} | "
                     f"{s['auto_over_best_max']:.3f} | {a['min']:.2f} / {a['median']:.2f} / "
                     f"{a['max']:.2f} | {b['min']:.2f} / {b['median']:.2f} / {b['max']:.2f} | "
                     f"{s['model_picks_best']:.0%} |")
    return "\n".join(lines)
