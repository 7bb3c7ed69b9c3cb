"""Price single collectives and GEMMs with XLA's latency estimator (deviceless GPU compiles) and
write them as a calibration profile with source "xla".
`python scripts/xla_sweep.py --target h100:8 --out benchmarks/results/xla_profile_h100x8.json`.

Every flag is documented in docs/cli.md.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

from oases_jax import provenance
from oases_jax.cli import Parser, add_runtime_flags, init_runtime, run_main, write_atomic


def parse_args(argv=None):
    p = Parser(prog="xla_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("--target", default="h100:8",
                   help="a GPU target: GPU:N with GPU h100, h200, a100 or 3090")
    p.add_argument("--out", required=True, help="the profile JSON to write")
    p.add_argument("--table", metavar="OUT.md", help="also write the markdown tables here")
    p.add_argument("--quick", action="store_true",
                   help="three sizes, one GEMM shape: a seconds-long smoke run")
    add_runtime_flags(p)
    return p.parse_args(argv)


def main() -> int:
    args = parse_args()
    if not os.environ.get("JAX_PLATFORMS"):
        import jax

        jax.config.update("jax_platforms", "cpu")  # compiling for GPUs that are not here
    init_runtime(args)
    import jax

    from oases_jax.errors import UserError
    from oases_jax.targets import get_target
    from oases_jax.tools.analysis import xla_sweep

    target = get_target(args.target)
    if not target.is_gpu_aot:
        raise UserError(f"--target {args.target!r}: XLA's estimator prices GPU programs; use "
                        "h100:8, h200:8 or a100:8")
    cfg = xla_sweep.SweepConfig()
    if args.quick:
        cfg = xla_sweep.SweepConfig(sizes=(64 * 2**10, 2**20, 16 * 2**20),
                                    gemm_shapes=((4096, 4096, 4096),), chunks=(1, 4))
    gemm, comm = xla_sweep.sweep(target.devices, cfg,
                                 log=lambda s: print(s, file=sys.stderr, flush=True))
    cluster = target.cluster
    meta = {**provenance.record(), "target": args.target,
            "estimator": "XLA latency-hiding scheduler, sol prices"}
    try:
        from oases_jax.planner.calibration.profile import Profile
    except ImportError:  # the planner's profile format is not in this checkout
        Profile = None
    if Profile is not None:
        Profile.from_samples(gemm, comm, source="xla", device=cluster.device,
                             n_devices=cluster.n_devices, meta=meta).save(args.out)
    else:
        write_atomic(args.out, json.dumps({"source": "xla", "device": cluster.device,
                                           "n_devices": cluster.n_devices, "meta": meta,
                                           "samples": {"gemm": gemm, "comm": comm}}, indent=1))
    link = cluster.link_for(range(cluster.devices_per_node))
    tables = (f"Collectives on {args.target}: XLA's estimator vs datasheet alpha-beta "
              f"({link.name}, {link.bytes_per_s / 1e9:.0f} GB/s, {link.latency_s * 1e6:.0f} us)\n\n"
              + xla_sweep.bandwidth_table(comm, link) + "\n\nGEMMs\n\n"
              + xla_sweep.gemm_table(gemm, cluster.device_spec.peak) + "\n")
    print(tables)
    if args.table:
        pathlib.Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        write_atomic(args.table, tables)
    print(f"wrote {args.out}: {len(comm)} collective and {len(gemm)} GEMM samples",
          file=sys.stderr)
    return 0


def cli() -> None:
    """The console entry point (`[project.scripts]` in pyproject.toml)."""
    run_main(main)


if __name__ == "__main__":
    cli()
