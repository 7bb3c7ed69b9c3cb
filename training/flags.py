"""The model flags every script shares: a preset plus typed overrides."""

from __future__ import annotations

import argparse

from models.config import REMAT_POLICIES, ModelConfig


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
    from models.presets import get_preset

    model = get_preset(args.model).with_overrides(args.model_set)
    given = (("dtype", args.dtype), ("remat", args.remat), ("scan_layers", args.scan))
    return model.replace(**{k: v for k, v in given if v is not None})
