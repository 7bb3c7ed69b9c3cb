"""Plan a training run: `python scripts/plan.py --model gpt2-1.5b --cluster h100-8` prints the
ranked plans and writes the best with `--json plan.json`.

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import sys

from oases_jax import provenance
from oases_jax.cli import Parser, run_main
from oases_jax.training.flags import add_model_flags, model_from_flags


def parse_args(argv=None):
    p = Parser(prog="plan.py", description=__doc__.splitlines()[0])
    add_model_flags(p)
    g = p.add_argument_group("workload")
    g.add_argument("--cluster", default="cpu-8",
                   help="built-in cluster name, a target like h100:16, or a cluster JSON file")
    g.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    g.add_argument("--seq-len", type=int, default=None, help="default: the model's max_seq_len")
    g.add_argument("--memory-fraction", type=float, default=None,
                   help="share of each device's memory a plan may use (default: 0.76 on GPUs, "
                        "the memory XLA's GPU scheduler plans within; 0.9 on CPUs)")
    g.add_argument("--schedules", metavar="A,B,...", help="restrict the per-layer schedules")
    g.add_argument("--expert-degrees", metavar="A,B,...",
                   help="MoE models: the expert degrees (sizes of the expert mesh axis) to "
                        "search, each dividing the experts and the devices (default: all such)")
    g.add_argument("--moe-schedules", metavar="A,B,...",
                   help="MoE models: the MoE schedules to search on an expert axis, of ds_moe, "
                        "parm_s1, parm_s2 (default: all three; parm_s2 with each chunk count)")
    g.add_argument("--pipeline", action="store_true",
                   help="also search data x stage x tensor with pipeline schedules (dense "
                   "models): the 3D plan is chosen when it is faster than the best 2D one")
    g.add_argument("--verify", type=int, default=0, metavar="N",
                   help="compile the top N plans (by predicted step) for the cluster (without a "
                        "GPU for GPU clusters), report each one's compiled peak memory, our "
                        "simulated step, XLA's estimate and GEMM-in-window share beside the "
                        "prediction, and write the plan that fits the device memory with the "
                        "fastest simulated step (our simulator ranks, not the prediction nor "
                        "XLA); costs a compile per plan. 0: off (default)")
    g = p.add_argument_group("costs")
    g.add_argument("--cost-source", default="datasheet", help="datasheet, profile or xla")
    g.add_argument("--profile",
                   help="calibration profile JSON (default: planner/profiles/DEVICE-N.json)")
    g = p.add_argument_group("output")
    g.add_argument("--top", type=int, default=10, help="rows of the ranked table")
    g.add_argument("--json", metavar="OUT", help="write the best plan here")
    g.add_argument("--save-cluster", metavar="OUT",
                   help="write --cluster as a cluster JSON to edit into your own, and exit")
    g.add_argument("--explain", action="store_true", help="why each layer got its strategy")
    g.add_argument("--compare", metavar="MODELS",
                   help="comma-separated presets (or `oases-family`): one row each with the "
                        "predicted speedup of the chosen plan over the best megatron plan")
    g.add_argument("--compare-sources", metavar="A,B,...",
                   help="comma-separated cost sources (datasheet, profile, xla): one row each "
                        "(per --compare model) with the chosen plan, its step and exposed "
                        "communication, and the best megatron plan under that source")
    return p.parse_args(argv)


def _ms(s: float) -> str:
    return f"{s * 1e3:10.2f}"


def ranked_table(result, top: int) -> str:
    """The best plan of each layout, fastest first. MoE plans add what decides the expert
    degree: the step's MoE feed-forwards, the communication they expose, and the gradient
    reduction (dense gradients over data x expert, the experts' over data)."""
    moe = hasattr(result.best, "moe")
    shown = result.ranked[:top]
    width = max([len("plan"), *(len(c.summary()) for c in shown)])  # whole, never cut
    head = f"{'#':>3}  {'plan':<{width}} {'step ms':>10} {'exposed':>10} {'peak GiB':>9}"
    rows = [head + (f" {'MoE ms':>9} {'MoE comm':>9} {'reduce':>9}" if moe else "")]
    for i, c in enumerate(shown):
        row = (f"{i + 1:3d}  {c.summary():<{width}} {_ms(c.cost.step_s)} "
               f"{_ms(c.cost.exposed_comm_s)} {c.cost.peak_memory_bytes / 2**30:9.2f}")
        if moe:
            row += (f" {c.step.moe_s * 1e3:9.2f} {c.step.moe_comm_s * 1e3:9.2f} "
                    f"{c.step.reduce_s * 1e3:9.2f}")
        rows.append(row)
    return "\n".join(rows)


def moe_baselines(result) -> str:
    """Why the chosen expert degree: the best plan with and without an expert axis (their MoE
    communication and gradient reduction side by side), and the speedup over ds_moe."""
    b = result.best
    lines = []
    for key, what in (("no_expert", "best without an expert axis"),
                      ("expert", "best with an expert axis"), ("ds_moe", "best under ds_moe")):
        c = result.baselines.get(key)
        if c is None:
            lines.append(f"{what}: none fits")
            continue
        lines.append(f"{what}: {c.summary()}  {c.cost.step_s * 1e3:.2f} ms (MoE comm "
                     f"{c.step.moe_comm_s * 1e3:.2f} ms, gradient reduction "
                     f"{c.step.reduce_s * 1e3:.2f} ms, {c.cost.peak_memory_bytes / 2**30:.2f} "
                     f"GiB); chosen plan {c.cost.step_s / b.cost.step_s:.2f}x faster")
    return "\n".join(lines)


def explain_moe(result, cfg, hw) -> str:
    """For the chosen layout: every (dense strategy, MoE schedule) pair's step, MoE time and
    memory, and why the layers share one strategy."""
    from oases_jax.planner.search.dense import REMATS, SCHEDULES
    from oases_jax.planner.search.moe import UNIFORM, plan_moe_layout

    best = result.best
    lines = [f"layout {best.layout.label()}: each dense strategy x MoE schedule (whole step)",
             f"{'dense':<24} {'MoE':<10} {'step ms':>9} {'MoE ms':>9} {'MoE comm':>9} "
             f"{'peak GiB':>9}"]
    for c in plan_moe_layout(cfg, best.layout, hw, result.budget_bytes, SCHEDULES, REMATS,
                             ("ds_moe", "parm_s1", "parm_s2")):
        fits = c.cost.peak_memory_bytes <= result.budget_bytes
        mark = "  <- chosen" if c == best else "" if fits else "  (does not fit)"
        lines.append(f"{c.dense.label():<24} {c.moe.label():<10} {c.cost.step_s * 1e3:9.2f} "
                     f"{c.step.moe_s * 1e3:9.2f} {c.step.moe_comm_s * 1e3:9.2f} "
                     f"{c.cost.peak_memory_bytes / 2**30:9.2f}{mark}")
    lines.append(f"{UNIFORM}; the MoE feed-forwards are priced by the alpha-beta MoE model "
                 "(oases_jax/moe/cost.py) on the datasheet numbers")
    return "\n".join(lines)


def explain(result, cfg, hw) -> str:
    """For the chosen layout: every strategy's layer time and memory, and the choice."""
    from oases_jax.planner.cost.layer_cost import LayerModel
    from oases_jax.planner.search.dense import strategies

    best = result.best
    lm = LayerModel(cfg, best.layout, hw)
    costs = {s: lm.time(s) for s in strategies(best.layout)}
    chosen = set(best.strategies)
    lines = [f"layout {best.layout.label()}: per-layer candidates (one micro-batch)",
             f"{'strategy':<28} {'fwd+bwd ms':>10} {'comm ms':>9} {'saved MiB':>10} "
             f"{'temp MiB':>9}"]
    ranked = sorted(costs, key=lambda s: costs[s].step_s)
    for s in ranked:
        c = costs[s]
        mark = "  <- chosen" if s in chosen else ""
        lines.append(f"{s.label():<28} {c.step_s * 1e3:10.3f} {c.comm_s * 1e3:9.3f} "
                     f"{c.act_bytes / 2**20:10.1f} {c.temp_bytes / 2**20:9.1f}{mark}")
    fastest = ranked[0]
    if fastest not in chosen:
        lines.append(f"the fastest layer strategy {fastest.label()} does not fit "
                     f"{result.budget_bytes / 2**30:.1f} GiB for all {cfg.n_layers} layers; the "
                     "DP traded time for memory on some layers")
    else:
        lines.append(f"every layer takes the fastest strategy, {fastest.label()}: it fits")
    return "\n".join(lines)


OASES_FAMILY = ("oases-h1024-l24", "oases-h2048-l24", "oases-h3072-l24", "oases-h4096-l16",
                "oases-h6144-l16", "oases-h8192-l8", "oases-h12288-l4")


def compare_table(args, cluster, profiles: dict, schedules) -> str:
    """One row per model (`--compare`, else `--model`) and cost source (`profiles`: source ->
    calibration profile): the chosen plan, the best megatron plan and the predicted speedup,
    each under that source."""
    from oases_jax.errors import UserError
    from oases_jax.models.presets import get_preset
    from oases_jax.planner import make_plan

    if args.compare:
        names = OASES_FAMILY if args.compare == "oases-family" else args.compare.split(",")
        configs = [(n.strip(), get_preset(n.strip())) for n in names]
    else:
        configs = [(args.model, model_from_flags(args))]
    cells = []  # (model, source, chosen, ms, exposed, megatron plan, ms, speedup) or an error
    for name, cfg in configs:
        for source, profile in profiles.items():
            try:
                _, r = make_plan(cfg, model=name, cluster=cluster,
                                 global_batch=args.global_batch,
                                 seq_len=args.seq_len or cfg.max_seq_len,
                                 memory_fraction=args.memory_fraction, profile=profile,
                                 cost_source=source, schedules=schedules)
            except UserError as e:
                cells.append((name, source, f"infeasible: {e}"))
                continue
            b, m = r.best, r.baselines.get("megatron")
            cells.append((name, source, b.summary(), b.cost.step_s * 1e3,
                          b.cost.exposed_comm_s * 1e3, m.summary() if m else "-",
                          m.cost.step_s * 1e3 if m else float("nan"),
                          m.cost.step_s / b.cost.step_s if m else float("nan")))
    # Plan descriptions whole, never cut: each column as wide as its longest.
    wide = [c for c in cells if len(c) > 3]
    w_model = max([len("model"), *(len(c[0]) for c in cells)])
    w_chosen = max([len("chosen plan"), *(len(c[2]) for c in wide)])
    w_mega = max([len("megatron plan"), *(len(c[5]) for c in wide)])
    rows = [f"{'model':<{w_model}} {'source':<9} {'chosen plan':<{w_chosen}} {'ms':>9} "
            f"{'exposed':>8} {'megatron plan':<{w_mega}} {'ms':>9} {'speedup':>7}"]
    for c in cells:
        if len(c) == 3:
            rows.append(f"{c[0]:<{w_model}} {c[1]:<9} {c[2]}")
            continue
        name, source, chosen, ms, exposed, mega, m_ms, speedup = c
        rows.append(f"{name:<{w_model}} {source:<9} {chosen:<{w_chosen}} {ms:9.2f} "
                    f"{exposed:8.2f} {mega:<{w_mega}} {m_ms:9.2f} {speedup:7.2f}")
    return "\n".join(rows)


def compare_profiles(args, cluster) -> dict:
    """Source -> profile for `--compare-sources` (the `--cost-source` one with `--profile`, the
    others from their default files), all loaded before any search so a bad source fails
    first; with `--compare` alone, the `--cost-source` one."""
    from oases_jax.errors import UserError
    from oases_jax.planner import COST_SOURCES, load_profile

    if not args.compare_sources:
        return {args.cost_source: load_profile(args.cost_source, cluster, args.profile)}
    sources = [s.strip() for s in args.compare_sources.split(",") if s.strip()]
    if not sources or len(set(sources)) < len(sources):
        raise UserError(f"--compare-sources {args.compare_sources!r} needs distinct cost "
                        "sources, e.g. datasheet,xla")
    bad = [s for s in sources if s not in COST_SOURCES]
    if bad:
        raise UserError(f"unknown cost source {bad[0]!r} in --compare-sources; choose from "
                        f"{', '.join(COST_SOURCES)}")
    return {s: load_profile(s, cluster, args.profile if s == args.cost_source else None)
            for s in sources}


def check_args(args) -> None:
    """Sizes, fractions, counts and output paths, before the cluster, profiles or search."""
    import math

    from oases_jax.errors import UserError
    from oases_jax.files import output_file
    from oases_jax.schema import MAX_GLOBAL_BATCH, MAX_SEQ_LEN

    for flag, value, cap in (("--global-batch", args.global_batch, MAX_GLOBAL_BATCH),
                             ("--seq-len", args.seq_len, MAX_SEQ_LEN)):
        if value is not None and not 1 <= value <= cap:
            raise UserError(f"{flag} {value} must be in 1..{cap:,}")
    if args.memory_fraction is not None and not (math.isfinite(args.memory_fraction)
                                                 and 0 < args.memory_fraction <= 1):
        raise UserError(f"--memory-fraction {args.memory_fraction} must be in (0, 1]: the share "
                        "of each device's memory a plan may use")
    if args.pipeline and args.verify:
        raise UserError("--verify compiles 2D plans only; drop --verify with --pipeline (3D "
                        "plans: benchmarks/verify_3d.py, planner/verification/verify_pipeline.py)")
    if args.verify < 0:
        raise UserError(f"--verify {args.verify} must be >= 0 (0: no verification)")
    if args.top < 1:
        raise UserError(f"--top {args.top} must be >= 1 (rows of the ranked table)")
    if args.schedules is not None and not args.schedules.strip(", "):
        raise UserError(f"--schedules {args.schedules!r} names no schedule; e.g. megatron,oases")
    args.expert_degrees = _int_list("--expert-degrees", args.expert_degrees)
    if args.moe_schedules is not None:
        args.moe_schedules = tuple(s.strip() for s in args.moe_schedules.split(",") if s.strip())
        if not args.moe_schedules:
            raise UserError("--moe-schedules names no MoE schedule; e.g. parm_s1,parm_s2")
    for flag, value in (("--json", args.json), ("--save-cluster", args.save_cluster)):
        if value:
            output_file(value, flag)


def _int_list(flag: str, text: str | None) -> tuple[int, ...] | None:
    """`2,4` -> (2, 4); anything but positive integers is one line."""
    from oases_jax.errors import UserError

    if text is None:
        return None
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise UserError(f"{flag} {text!r} must be positive integers separated by commas, e.g. "
                        "1,2,4")
    return values


def search_plan(args, cfg, cluster, profile, seq_len, schedules):
    """(plan JSON, SearchResult): `planner.make_plan`, or for an MoE model the MoE search with
    --expert-degrees and --moe-schedules (refused for dense models)."""
    from oases_jax.errors import UserError
    from oases_jax.planner import make_plan
    from oases_jax.planner.plan import plan_json

    moe_flags = [f for f, v in (("--expert-degrees", args.expert_degrees),
                                ("--moe-schedules", args.moe_schedules)) if v is not None]
    if not cfg.moe:
        if moe_flags:
            raise UserError(f"{moe_flags[0]} needs an MoE model (n_experts set, e.g. --model "
                            f"small-moe); {args.model} is dense: drop it")
        return make_plan(cfg, model=args.model, cluster=cluster, global_batch=args.global_batch,
                         seq_len=seq_len, memory_fraction=args.memory_fraction, profile=profile,
                         cost_source=args.cost_source, schedules=schedules)
    from oases_jax.planner.cost.prices import Hardware
    from oases_jax.planner.search.moe import EP_SCHEDULES, search_moe

    result = search_moe(cfg, Hardware.of(cluster, profile), global_batch=args.global_batch,
                        seq_len=seq_len, memory_fraction=args.memory_fraction,
                        schedules=schedules, expert_degrees=args.expert_degrees,
                        moe_schedules=args.moe_schedules or EP_SCHEDULES)
    return plan_json(result, model=args.model, cfg=cfg, cluster=cluster.name,
                     cost_source=args.cost_source), result


def pipeline_choice(args, cfg, cluster, profile, seq_len, plan: dict, best_2d_s: float) -> dict:
    """`--pipeline`: the 3D search beside the 2D plan; returns the plan to write (the 3D one
    when it is faster)."""
    from oases_jax.errors import UserError
    from oases_jax.planner.cost.prices import Hardware
    from oases_jax.planner.plan import pipeline_plan_json, report_3d
    from oases_jax.planner.search.pipeline import megatron_3d, timed_search

    if cfg.moe:
        raise UserError("--pipeline plans dense models; MoE models are not pipelined yet: drop "
                        "--pipeline")
    hw = Hardware.of(cluster, profile)
    kw = dict(global_batch=args.global_batch, seq_len=seq_len,
              memory_fraction=args.memory_fraction)
    cands, secs = timed_search(cfg, hw, **kw)
    print(report_3d(cands, megatron_3d(cfg, hw, **kw), best_2d_s, secs, args.top))
    if cands and cands[0].step_s < best_2d_s:
        return pipeline_plan_json(cands[0], model=args.model, cfg=cfg, cluster=cluster.name,
                                  cost_source=args.cost_source, search_s=secs,
                                  alternatives=cands[1:args.top])
    return plan


def setup_verify(cluster) -> None:
    """Before JAX starts a backend: the devices `--verify` compiles for
    (`planner.verification.verify`), on the CPU backend: the cluster's count of CPU devices, or a
    GPU target compiled from the CPU."""
    import os

    import jax

    from oases_jax.planner.verification.verify import compile_target

    if compile_target(cluster) == "local":
        jax.config.update("jax_num_cpu_devices", cluster.n_devices)
    if not os.environ.get("JAX_PLATFORMS"):  # CPU devices, or GPUs compiled for from the CPU
        jax.config.update("jax_platforms", "cpu")


def agreement(verified) -> str:
    """Predicted against simulated step over the compiled plans: the ratio range and the
    Spearman rank correlation."""
    from oases_jax.planner.verification.rank import spearman

    done = [v for v in verified if v.simulated_step_s and not v.baseline]
    if len(done) < 2:
        return f"ranking agreement: {len(done)} plan(s) compiled, too few to rank"
    pred = [v.candidate.cost.step_s for v in done]
    sim = [v.simulated_step_s for v in done]
    ratios = [p / s for p, s in zip(pred, sim, strict=True)]
    return (f"predicted / simulated step over {len(done)} compiled plans: {min(ratios):.2f} to "
            f"{max(ratios):.2f}; ranking agreement (Spearman) {spearman(pred, sim):.2f}")


def warn_float32(name: str, cfg, cluster) -> None:
    """A one-line note on stderr when a float32 model is planned for a device whose bfloat16
    peak is at least twice its float32 one (a preset's dtype is what the plan prices)."""
    peaks = cluster.device_spec.peak_flops
    fp32, bf16 = peaks.get("float32"), peaks.get("bfloat16")
    if cfg.dtype == "float32" and fp32 and bf16 and bf16 >= 2 * fp32:
        print(f"note: {name} is planned in float32 (its dtype); {cluster.device_spec.name} "
              f"computes bfloat16 {bf16 / fp32:.0f}x faster: add --model-set dtype=bfloat16 to "
              "plan that", file=sys.stderr)


def main() -> int:
    args = parse_args()
    check_args(args)
    import time

    from oases_jax.errors import UserError
    from oases_jax.hardware import get_cluster
    from oases_jax.planner import load_profile
    from oases_jax.planner.cost.prices import Hardware
    from oases_jax.planner.plan import save
    from oases_jax.planner.search.dense import SCHEDULES

    cluster = get_cluster(args.cluster)
    if args.save_cluster:
        import json

        from oases_jax.cli import write_atomic

        write_atomic(args.save_cluster, json.dumps(cluster.to_json(), indent=1) + "\n")
        print(f"cluster {cluster.name} written to {args.save_cluster}")
        return 0
    cfg = model_from_flags(args)
    seq_len = args.seq_len or cfg.max_seq_len
    if args.verify:
        setup_verify(cluster)
    schedules = SCHEDULES
    if args.schedules is not None:
        schedules = tuple(s.strip() for s in args.schedules.split(","))
        bad = [s for s in schedules if s not in SCHEDULES]
        if bad:
            raise UserError(f"unknown schedule {bad[0]!r} in --schedules; choose from "
                            f"{', '.join(SCHEDULES)}")
    profile = load_profile(args.cost_source, cluster, args.profile)
    compared = compare_profiles(args, cluster) if args.compare or args.compare_sources else {}
    t0 = time.perf_counter()
    plan, result = search_plan(args, cfg, cluster, profile, seq_len, schedules)
    warn_float32(args.model, cfg, cluster)  # with a plan (a failure stays one line)
    print(f"{args.model} on {cluster.name} ({cluster.n_devices} x {cluster.device}), global "
          f"batch {args.global_batch} x {seq_len}, costs: {args.cost_source}; "
          f"{result.layouts_considered} layouts searched in {result.search_s:.2f} s "
          f"(wall {time.perf_counter() - t0:.2f} s)")
    print(ranked_table(result, args.top))
    best, base = result.best, result.baselines.get("megatron")
    print(f"best: {best.summary()}")
    if base is not None:
        print(f"megatron at its best mesh: {base.summary()}  {base.cost.step_s * 1e3:.2f} ms; "
              f"predicted speedup {base.cost.step_s / best.cost.step_s:.2f}x")
    if cfg.moe:
        print(moe_baselines(result))
    if args.explain:
        why = explain_moe if cfg.moe else explain
        print(why(result, cfg, Hardware.of(cluster, profile)))
    if compared:
        print(compare_table(args, cluster, compared, schedules))
    if args.pipeline:
        plan = pipeline_choice(args, cfg, cluster, profile, seq_len, plan, best.cost.step_s)
    if args.verify:
        from oases_jax.planner.verification.verify import verify_plan

        plan, verified, chosen = verify_plan(result, cfg, cluster, args.verify,
                                             model=args.model, cost_source=args.cost_source,
                                             log=lambda s: print(s, flush=True))
        print(f"chosen: {chosen.candidate.summary()} (predicted rank {chosen.rank}, "
              f"simulated {chosen.simulated_step_s * 1e3:.2f} ms)")
        print(agreement(verified))
    if args.json:
        save({**plan, "provenance": provenance.record()}, args.json)
        print(f"plan written to {args.json}")
    return 0


def cli() -> None:
    """The console entry point (`[project.scripts]` in pyproject.toml)."""
    run_main(main)


if __name__ == "__main__":
    cli()
