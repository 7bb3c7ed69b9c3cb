"""The model flags every script shares: a preset plus typed overrides."""

from __future__ import annotations

import argparse

from oases_jax.models.config import REMAT_POLICIES, ModelConfig


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    g.add_argument("--model", default="small", help="preset name (default small)")
    g.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one ModelConfig field, e.g. n_layers=2 (repeatable)")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype")
    g.add_argument("--remat", choices=REMAT_POLICIES, help="activation recomputation per layer")
    g.add_argument("--scan", action=argparse.BooleanOptionalAction, default=None,
                   help="scan over layers (default on)")


def model_from_flags(args: argparse.Namespace) -> ModelConfig:
    from oases_jax.models.presets import get_preset

    model = get_preset(args.model).with_overrides(args.model_set)
    given = (("dtype", args.dtype), ("remat", args.remat), ("scan_layers", args.scan))
    return model.replace(**{k: v for k, v in given if v is not None})


def add_layout_flags(group) -> None:
    """The MoE and pipeline flags of train.py and inspect_hlo.py (docs/cli.md)."""
    from oases_jax.moe import schedules as moe_schedules
    from oases_jax.pipeline import registry as pipelines

    group.add_argument("--moe-schedule", default="auto", help="MoE models: how MoE layers run: "
                       f"{', '.join(moe_schedules.CHOICES)} (default auto: by the cost model)")
    group.add_argument("--moe-chunks", type=int, default=0,
                       help="parm_s2's capacity chunks (default 0: the cost model's choice)")
    group.add_argument("--pipeline", help="pipeline schedule over the mesh's stage axis: "
                       f"{', '.join(pipelines.names(runnable=True))} (default: none)")
    group.add_argument("--stage-layers", help="layers per pipeline stage, e.g. 5,6,6,7 "
                       "(default uniform)")
    group.add_argument("--virtual-stages", type=int, default=0,
                       help=f"{', '.join(pipelines.names(chunked=True))}: model chunks per stage "
                       "(default: the schedule's, 2)")
    group.add_argument("--remat-ratios", help="stage-aware recompute: the first stage's ratio r0 "
                       "(Merak's rule for the others) or one ratio per stage, e.g. 0.8,0.7,0.4,0")
    group.add_argument("--backward-ticks", type=int, default=0,
                       help="pipelines: ticks one stage's backward spans, its layers split into "
                       "that many parts balanced by cost (default 0: one tick)")
    group.add_argument("--fused-ticks", default="auto", choices=("auto", "on", "off"),
                       help="pipelines: let one tick hold a stage's forward, recompute and "
                       "backward, so lockstep ticks are as long on every stage (default auto: "
                       "where that is faster in lockstep)")
    group.add_argument("--split-head", default="off", choices=("on", "off"),
                       help="pipelines: run the head (final norm, logits, loss) on every stage, "
                       "each its 1/S of the vocabulary, after the tick of the last stage's "
                       "forward, so the last stage does not carry it alone (needs unfused "
                       "ticks; default off)")


def layout_kwargs(args: argparse.Namespace, pipeline: str | None = None) -> dict:
    """The `ParallelConfig` fields `add_layout_flags` sets, the pipeline flags parsed into one
    `PipelineConfig` (None without --pipeline). `pipeline`: the schedule to use instead of
    --pipeline's (one of the schedules a comma list names, `inspect_hlo.py --pipeline a,b`)."""
    from oases_jax.pipeline.config import PipelineConfig

    config = PipelineConfig.from_flags(
        pipeline=pipeline or args.pipeline, stage_layers=args.stage_layers,
        virtual_stages=args.virtual_stages, remat_ratios=args.remat_ratios,
        backward_ticks=args.backward_ticks, fused_ticks=args.fused_ticks,
        split_head=args.split_head)
    return {"moe_schedule": args.moe_schedule, "moe_chunks": args.moe_chunks, "pipeline": config}
