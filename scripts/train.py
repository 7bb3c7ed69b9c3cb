"""Train a model: `python scripts/train.py` trains `small` on the stdlib corpus on 8 CPU devices.

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import datetime
import pathlib
import statistics

from oases_jax import registry
from oases_jax.cli import Parser, add_runtime_flags, init_runtime, run_main
from oases_jax.training.flags import (
    add_layout_flags,
    add_model_flags,
    layout_kwargs,
    model_from_flags,
)


def parse_args(argv=None):
    p = Parser(prog="train.py", description=__doc__.splitlines()[0])
    add_model_flags(p)
    g = p.add_argument_group("parallelism")
    g.add_argument("--mesh", default="data=2,tensor=4", help="ordered axes, one may be -1")
    g.add_argument("--rules", default="tp", help="dp, fsdp, tp, tp_sp or fsdp_tp (default tp)")
    g.add_argument("--schedule", default="megatron",
                   help=f"tensor-parallel schedule: {', '.join(registry.SCHEDULES)}")
    g.add_argument("--sub-batches", type=int, default=2, help="oases schedules: sub-batches")
    add_layout_flags(g)
    g.add_argument("--plan", help="a plan JSON from scripts/plan.py, or `auto` to plan for the "
                   "local devices (sets mesh, rules, micro-batches and each layer's strategy)")
    g.add_argument("--schedule-profile", metavar="FILE",
                   help="compile the step with this scheduling profile (from inspect_hlo.py "
                        "--write-schedule-profile): XLA's GPU scheduler orders it by its costs")
    g = p.add_argument_group("optimisation")
    g.add_argument("--steps", type=int, default=200, help="total optimizer steps of the run")
    g.add_argument("--batch-size", type=int, default=16, help="global batch (sequences)")
    g.add_argument("--microbatches", type=int, default=1, help="gradient-accumulation steps")
    g.add_argument("--seq-len", type=int, default=128)
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--warmup-steps", type=int, default=20)
    g.add_argument("--weight-decay", type=float, default=0.1)
    g.add_argument("--clip-norm", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--loss-spike", type=float, default=10.0,
                   help="a loss over this many times the median of the last 32 counts as "
                        "divergence (exit 3); 0: only NaN/Inf (default 10)")
    g.add_argument("--grad-norm-limit", type=float,
                   help="a gradient norm over this counts as divergence (exit 3; default off)")
    g = p.add_argument_group("data, logging and checkpoints")
    g.add_argument("--data", default="stdlib", help="stdlib, a text file or dir, or a .bin")
    g.add_argument("--log-every", type=int, default=10)
    g.add_argument("--eval-every", type=int, default=100)
    g.add_argument("--eval-batches", type=int, default=4)
    g.add_argument("--out-dir", help="run directory (default runs/MODEL-TIMESTAMP)")
    g.add_argument("--metrics-out", help="JSONL metrics file (default OUT_DIR/metrics.jsonl)")
    g.add_argument("--ckpt-dir", help="checkpoint directory (default OUT_DIR/ckpt)")
    g.add_argument("--ckpt-every", type=int, default=100)
    g.add_argument("--keep", type=int, default=3, help="checkpoints kept")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    g.add_argument("--stop-after", type=int, help="end this run after N steps (checkpointed)")
    g.add_argument("--peak-tflops", type=float, help="per-device peak for MFU on unknown devices")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_runtime_flags(p)
    return p.parse_args(argv)


def build_config(args):
    from oases_jax.errors import UserError
    from oases_jax.training import (
        CheckpointConfig,
        DivergenceConfig,
        OptimConfig,
        ParallelConfig,
        TrainConfig,
    )

    model = model_from_flags(args)
    import jax

    parallel = ParallelConfig(mesh=args.mesh, rules=args.rules, schedule=args.schedule,
                              sub_batches=args.sub_batches, **layout_kwargs(args))
    batch_size, microbatches, seq_len = args.batch_size, args.microbatches, args.seq_len
    if args.plan:
        model, parallel, batch_size, microbatches, seq_len = plan_config(args, model)

    if jax.process_count() > 1 and not (args.out_dir or (args.ckpt_dir and args.metrics_out)):
        raise UserError(
            "a multi-process run needs --out-dir DIR (the same shared path on every process)"
        )
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = pathlib.Path(args.out_dir or f"runs/{args.model}-{stamp}")
    cfg = TrainConfig(
        model=model,
        optim=OptimConfig(
            lr=args.lr,
            warmup_steps=args.warmup_steps,
            weight_decay=args.weight_decay,
            clip_norm=args.clip_norm,
        ),
        parallel=parallel,
        ckpt=CheckpointConfig(
            dir=args.ckpt_dir or str(out / "ckpt"),
            every=args.ckpt_every,
            resume=args.resume,
            keep=args.keep,
        ),
        divergence=DivergenceConfig(loss_spike=args.loss_spike,
                                    grad_norm_limit=args.grad_norm_limit),
        data=args.data,
        steps=args.steps,
        batch_size=batch_size,
        microbatches=microbatches,
        seq_len=seq_len,
        seed=args.seed,
        log_every=args.log_every,
        eval_every=args.eval_every,
        eval_batches=args.eval_batches,
        metrics_out=args.metrics_out or str(out / "metrics.jsonl"),
        stop_after=args.stop_after,
        peak_tflops=args.peak_tflops,
        progress=not args.no_progress,
        schedule_profile=args.schedule_profile,
    )
    check_paths(args, cfg)
    return cfg


def check_paths(args, cfg) -> None:
    """The run's output and data paths, before anything compiles: a file where a directory
    belongs (or the reverse), and data that is missing, empty, a FIFO or a device, are one line
    now rather than a traceback after the compile."""
    from oases_jax.files import output_dir, output_file
    from oases_jax.training.data import data_files
    from oases_jax.training.program import check_schedule_profile

    if args.schedule_profile:
        check_schedule_profile(args.schedule_profile)
    if args.out_dir:
        output_dir(args.out_dir, "--out-dir")
    output_dir(cfg.ckpt.dir, "--ckpt-dir" if args.ckpt_dir else "--out-dir")
    output_file(cfg.metrics_out, "--metrics-out" if args.metrics_out else "--out-dir")
    data_files(cfg.data)


def plan_config(args, model):
    """(model, ParallelConfig, batch size, micro-batches, seq len) from --plan FILE or --plan
    auto; the model is --model's, with an MoE plan's remat policy (`Plan.run_model`)."""
    import jax

    from oases_jax.planner import local_cluster, make_plan
    from oases_jax.planner import plan as plans
    from oases_jax.planner.calibration.profile import Profile, default_profile_path

    if args.plan == "auto":
        cluster = local_cluster(jax.devices())
        path = default_profile_path(cluster.device, cluster.n_devices)
        profile = Profile.load(path) if path.exists() else None
        source = "profile" if profile else "datasheet"
        d, _ = make_plan(model, model=args.model, cluster=cluster, global_batch=args.batch_size,
                         seq_len=args.seq_len, profile=profile, cost_source=source)
        plan = plans.from_json(d, "auto plan")
        moe = f", moe {d['moe']['schedule']}" if d.get("moe") else ""
        print(f"plan auto ({source} costs on {cluster.name}): mesh {plan.mesh}, "
              f"{plan.microbatches} micro-batch(es), layers "
              f"{', '.join(s.label() for s in plan.layers[:1])}"
              f"{' ...' if len(set(plan.layers)) > 1 else ''}"
              f"{moe}; predicted "
              f"{d['predicted_step_s'] * 1e3:.1f} ms/step")
    else:
        plan = plans.load(args.plan)
    plan.check_model(model)
    # The plan's own config (`Plan.parallel`): its per-layer strategies, its pipeline section,
    # or its MoE section (one dense strategy, the MoE schedule, the remat on the model).
    return (plan.run_model(model), plan.parallel(), plan.global_batch, plan.microbatches,
            plan.seq_len)


def main() -> int:
    args = parse_args()
    init_runtime(args)
    cfg = build_config(args)
    import jax

    from oases_jax.training import train

    result = train(cfg)
    if jax.process_index() == 0 and result.losses:
        steps = sorted(result.losses)
        print(
            f"steps {steps[0]}..{steps[-1]} ({result.stopped}): loss "
            f"{result.losses[steps[0]]:.4f} -> {result.losses[steps[-1]]:.4f}; "
            f"checkpoint {cfg.ckpt.dir}; metrics {cfg.metrics_out}"
        )
        _print_throughput(cfg.metrics_out)
    return 0


def _print_throughput(path: str) -> None:
    import json

    rates = [
        r["tokens_per_s"]
        for r in map(json.loads, pathlib.Path(path).read_text().splitlines())
        if "tokens_per_s" in r
    ]
    if rates:
        print(f"tokens/s: median {statistics.median(rates):,.0f} over {len(rates)} log windows")


def cli() -> None:
    """The console entry point (`[project.scripts]` in pyproject.toml)."""
    from oases_jax.training import TrainingDiverged
    from oases_jax.training.checkpoint import CheckpointWriteError, NoIntactCheckpoint

    run_main(main, extra_errors={TrainingDiverged: 3, CheckpointWriteError: 5,
                                 NoIntactCheckpoint: 6})


if __name__ == "__main__":
    cli()
