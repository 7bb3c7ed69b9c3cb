"""Measure GEMM and collective costs on the local devices and write a calibration profile.
`python scripts/calibrate.py` measures 8 virtual CPU devices (about a minute on 2 cores) and
writes planner/profiles/cpu-8.json, which the planner prefers over datasheet numbers.

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

from oases_jax import provenance
from oases_jax.cli import Parser, add_runtime_flags, init_runtime, run_main

KIB = 2**10
# Defaults of the flags that --quick changes: a seconds-long smoke run for tests.
FULL = {"tokens": 512, "square_sizes": (128, 256, 512), "dtypes": ("float32", "bfloat16"),
        "max_bytes": 4 * 2**20, "memory_sizes": (2**20, 2**22, 2**24, 2**26), "repeats": 10,
        "warmup": 2, "projections": True}
QUICK = {"tokens": 128, "square_sizes": (128, 512), "dtypes": ("float32",), "max_bytes": 32 * KIB,
         "memory_sizes": (2**22, 2**24, 2**26), "repeats": 3, "warmup": 1, "projections": False}


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list like 1,2,4") from None
    if any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must hold positive integers")
    return values


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _bytes(text: str) -> int:
    """1048576, 1024K, 1M or 1MiB (binary units)."""
    units = {"": 1, "k": KIB, "m": 2**20, "g": 2**30}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    suffix = t[-1:] if t[-1:] in "kmg" else ""
    try:
        value = float(t[: len(t) - len(suffix)]) * units[suffix]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 65536, 64K or 4M") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a positive whole number of bytes")
    return int(value)


def parse_args(argv=None):
    p = Parser(prog="calibrate.py", description=__doc__.splitlines()[0])
    g = p.add_argument_group("GEMMs")
    g.add_argument("--model", default="small",
                   help="preset whose layer projections are measured (default small)")
    g.add_argument("--model-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one ModelConfig field of --model (repeatable)")
    g.add_argument("--tokens", type=int, help="rows m of the projection GEMMs (default 512)")
    g.add_argument("--tensor", type=int, default=1,
                   help="measure the projections as one device of a T-way Megatron split holds "
                   "them: column-parallel n / T, row-parallel k / T (default 1: unsharded)")
    g.add_argument("--square-sizes", type=_ints, metavar="A,B,...",
                   help="square GEMMs m=k=n also measured (default 128,256,512)")
    g.add_argument("--chunks", type=_ints, default=(1, 2, 4, 8), metavar="A,B,...",
                   help="chunk counts along m (default 1,2,4,8)")
    g.add_argument("--dtypes", type=_names, metavar="A,B",
                   help="GEMM dtypes (default float32,bfloat16)")
    g = p.add_argument_group("collectives")
    g.add_argument("--kinds", type=_names, metavar="A,B,...",
                   help="collectives (default all-reduce,all-gather,reduce-scatter,all-to-all,"
                   "collective-permute)")
    g.add_argument("--axis-sizes", type=_ints, metavar="A,B,...",
                   help="group sizes (default the powers of two from 2 dividing the device count)")
    g.add_argument("--min-bytes", type=_bytes, default=16 * KIB,
                   help="smallest collective size, doubled up to --max-bytes (default 16K)")
    g.add_argument("--max-bytes", type=_bytes, help="largest collective size (default 4M)")
    g.add_argument("--memory-sizes", type=lambda t: tuple(_bytes(v) for v in t.split(",")),
                   metavar="A,B,...",
                   help="bytes per device of the memory passes (default 1M,4M,16M,64M)")
    g = p.add_argument_group("measurement")
    g.add_argument("--groups", choices=("all", "one"), default="all",
                   help="all: every device busy at once, as in a training step (default); "
                   "one: one device or group, the rest idle")
    g.add_argument("--repeats", type=int, help="timed runs per measurement (default 10)")
    g.add_argument("--warmup", type=int, help="untimed runs per measurement (default 2)")
    g.add_argument("--min-program-ms", type=float, default=5.0,
                   help="chain calls until they add this much to a program (default 5)")
    g.add_argument("--quick", action="store_true",
                   help="a seconds-long smoke run: tiny shapes, float32, 16K-32K collectives, "
                   "256K-4M memory passes, 3 repeats")
    g.add_argument("--out", help="profile JSON (default planner/profiles/DEVICE-N.json in the "
                   "repository)")
    add_runtime_flags(p)
    return p.parse_args(argv)


def check_args(args) -> None:
    """Counts, times and the output path, before any device is touched."""
    import math

    from oases_jax.errors import UserError
    from oases_jax.files import output_file

    for flag, value, least in (("--tensor", args.tensor, 1), ("--tokens", args.tokens, 1),
                               ("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0)):
        if value is not None and value < least:
            raise UserError(f"{flag} {value} must be >= {least}")
    if not (math.isfinite(args.min_program_ms) and args.min_program_ms > 0):
        raise UserError(f"--min-program-ms {args.min_program_ms} must be a positive number")
    if args.out:
        output_file(args.out, "--out")


def build_config(args, n_devices: int):
    from oases_jax.models.presets import get_preset
    from oases_jax.planner.calibration.calibrate import (
        CalibrationConfig,
        byte_sizes,
        default_axis_sizes,
        projection_shapes,
    )
    from oases_jax.planner.calibration.profile import COMM_KINDS

    base = QUICK if args.quick else FULL
    tokens = args.tokens if args.tokens is not None else base["tokens"]
    squares = args.square_sizes if args.square_sizes is not None else base["square_sizes"]
    shapes = []
    model = get_preset(args.model).with_overrides(args.model_set)  # checked even if unused
    if base["projections"] or args.tokens is not None:
        shapes += projection_shapes(model, tokens, args.tensor)
    shapes += [(s, s, s) for s in squares]
    return CalibrationConfig(
        gemm_shapes=tuple(dict.fromkeys(shapes)),
        dtypes=args.dtypes or base["dtypes"],
        chunks=args.chunks,
        kinds=args.kinds or COMM_KINDS,
        axis_sizes=args.axis_sizes or default_axis_sizes(n_devices),
        sizes=byte_sizes(args.min_bytes, args.max_bytes or max(base["max_bytes"], args.min_bytes)),
        memory_sizes=args.memory_sizes or base["memory_sizes"],
        repeats=args.repeats if args.repeats is not None else base["repeats"],
        warmup=args.warmup if args.warmup is not None else base["warmup"],
        groups=args.groups,
        min_program_s=args.min_program_ms / 1e3,
    )


def main() -> int:
    args = parse_args()
    check_args(args)
    init_runtime(args)
    import jax

    from oases_jax.files import output_file
    from oases_jax.planner.calibration.calibrate import (
        calibrate,
        check_axis_sizes,
        format_table,
        local_device_name,
    )
    from oases_jax.planner.calibration.profile import default_profile_out

    cfg = build_config(args, len(jax.devices()))
    check_axis_sizes(cfg, len(jax.devices()))
    device = local_device_name()
    out = output_file(args.out or default_profile_out(device, len(jax.devices())), "--out")
    main_process = jax.process_index() == 0

    def log(msg: str) -> None:
        if main_process:
            print(msg, file=sys.stderr, flush=True)

    meta = {**provenance.record(), "host": platform.node(),
            "device_kind": jax.devices()[0].device_kind, "load_average": [os.getloadavg()[0]],
            "host_cores": len(os.sched_getaffinity(0))}
    prof = calibrate(cfg, log, device=device, meta=meta)
    prof.meta["load_average"].append(os.getloadavg()[0])  # other processes skew the figures
    if main_process:
        print(format_table(prof), end="")
        prof.save(out)
        log(f"wrote {out}")
    return 0


def cli() -> None:
    """The console entry point (`[project.scripts]` in pyproject.toml)."""
    run_main(main)


if __name__ == "__main__":
    cli()
