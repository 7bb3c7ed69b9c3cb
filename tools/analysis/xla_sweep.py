"""XLA's latency estimator as a cost source: deviceless GPU compiles of single collectives and
GEMMs over a range of sizes, each priced by XLA, returned as calibration-profile samples.

Samples follow `planner.calibration.profile`: comm {"kind", "n", "bytes", "seconds"} with bytes
as in `oases_jax.hardware.collective_time`, gemm {"m", "n", "k", "dtype", "chunks", "seconds"}.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.hardware import collective_time
from oases_jax.tools.analysis.xla_compile import schedule_dump
from oases_jax.tools.analysis.xla_estimate import collective_prices, estimate_from_hlo_text

KIB, MIB = 2**10, 2**20
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
GROUPS = (2, 4, 8)
SIZES = tuple(64 * KIB * 2**i for i in range(13))  # 64 KiB .. 256 MiB
GEMM_SHAPES = ((1024, 1024, 1024), (4096, 4096, 4096), (8192, 4096, 16384), (8192, 16384, 4096),
               (8192, 6400, 1600), (8192, 1600, 6400))
GEMM_DTYPES = ("bfloat16", "float32")
CHUNKS = (1, 2, 4, 8)
_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SweepConfig:
    kinds: tuple[str, ...] = KINDS
    groups: tuple[int, ...] = GROUPS
    sizes: tuple[int, ...] = SIZES  # bytes as in collective_time
    dtype: str = "bfloat16"  # of the collectives' buffers
    gemm_shapes: tuple[tuple[int, int, int], ...] = GEMM_SHAPES
    gemm_dtypes: tuple[str, ...] = GEMM_DTYPES
    chunks: tuple[int, ...] = CHUNKS

    def __post_init__(self):
        bad = [k for k in self.kinds if k not in KINDS]
        if bad:
            raise ValueError(f"unknown collective kinds {bad}; use {', '.join(KINDS)}")


def _collective_fn(kind: str, n: int) -> Callable:
    """The per-device body of one collective over the mesh axis "g" of size n."""
    if kind == "all-reduce":
        return lambda x: jax.lax.psum(x, "g")
    if kind == "all-gather":
        return lambda x: jax.lax.all_gather(x, "g", tiled=True)
    if kind == "reduce-scatter":
        return lambda x: jax.lax.psum_scatter(x, "g", tiled=True)
    if kind == "all-to-all":
        return lambda x: jax.lax.all_to_all(x, "g", 0, 0, tiled=True)
    perm = [(i, (i + 1) % n) for i in range(n)]
    return lambda x: jax.lax.ppermute(x, "g", perm)


def _input_elems(kind: str, nbytes: int, n: int, itemsize: int) -> int:
    """Per-device input elements whose collective moves `nbytes` in collective_time's terms:
    the gathered output for all-gather (input = S/n), the input for the others."""
    elems = nbytes // itemsize
    return elems // n if kind == "all-gather" else elems


def collective_program(kind: str, n: int, nbytes: int, devices, dtype: str = "bfloat16"):
    """The lowered program of one `kind` over groups of `n` of `devices` moving `nbytes`."""
    itemsize = jnp.dtype(dtype).itemsize
    rows = _input_elems(kind, nbytes, n, itemsize)
    mesh = Mesh(np.asarray(devices, dtype=object).reshape(-1, n), ("rest", "g"))
    # Each device holds a block [rows] of a global [n * rows], replicated over "rest".
    f = jax.shard_map(_collective_fn(kind, n), mesh=mesh, in_specs=P("g"), out_specs=P("g"),
                      check_vma=False)
    x = jax.ShapeDtypeStruct((n * rows,), jnp.dtype(dtype), sharding=NamedSharding(mesh, P("g")))
    return jax.jit(f).lower(x)


def collective_seconds(kind: str, n: int, nbytes: int, devices, dtype: str = "bfloat16"
                       ) -> float | None:
    """XLA's price of one `kind` over groups of `n` of `devices`, moving `nbytes` (None when XLA
    gives the collective no price)."""
    lowered = collective_program(kind, n, nbytes, devices, dtype)
    with schedule_dump() as (options, where):
        lowered.compile(compiler_options={**_OPTIONS, **options})
        files = sorted(where.glob("*.schedule.txt"))
        if not files:
            return None
        prices = [s for _, k, s in collective_prices(files[0].read_text()) if k == kind]
    return prices[0] if len(prices) == 1 else None


def gemm_seconds(m: int, n: int, k: int, dtype: str, device) -> float:
    """XLA's price of one [m, k] @ [k, n] GEMM on one device (the program is that dot)."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    a = jax.ShapeDtypeStruct((m, k), jnp.dtype(dtype), sharding=sharding)
    b = jax.ShapeDtypeStruct((k, n), jnp.dtype(dtype), sharding=sharding)
    compiled = jax.jit(jnp.matmul).lower(a, b).compile(
        compiler_options={"xla_gpu_collect_cost_model_stats": True})
    return estimate_from_hlo_text(compiled.as_text()).step_s


def sweep(devices, cfg: SweepConfig = SweepConfig(), log: Callable[[str], None] = print
          ) -> tuple[list[dict], list[dict]]:
    """(gemm samples, comm samples) priced by XLA for the compile-only `devices`."""
    comm = []
    for kind in cfg.kinds:
        for n in cfg.groups:
            if n > len(devices) or len(devices) % n:
                continue
            for nbytes in cfg.sizes:
                secs = collective_seconds(kind, n, nbytes, devices, cfg.dtype)
                if secs is None or secs <= 0:
                    log(f"  {kind} n={n} {nbytes} B: XLA gave no price; skipped")
                    continue
                comm.append({"kind": kind, "n": n, "bytes": nbytes, "seconds": secs,
                             "dtype": cfg.dtype})
            log(f"{kind} over {n}: {len(cfg.sizes)} sizes priced")
    gemm = []
    for dtype in cfg.gemm_dtypes:
        for m, n, k in cfg.gemm_shapes:
            for chunks in cfg.chunks:
                if m % chunks:
                    continue
                secs = chunks * gemm_seconds(m // chunks, n, k, dtype, devices[0])
                gemm.append({"m": m, "n": n, "k": k, "dtype": dtype, "chunks": chunks,
                             "seconds": secs})
        log(f"GEMMs {dtype}: {len(cfg.gemm_shapes)} shapes x {len(cfg.chunks)} chunk counts")
    return gemm, comm


def _size(nbytes: int) -> str:
    return f"{nbytes // MIB} MiB" if nbytes >= MIB else f"{nbytes // KIB} KiB"


def bandwidth_table(comm: list[dict], link) -> str:
    """Markdown: per kind, group size and size, the effective bandwidth S / t (S as in
    collective_time) under XLA's estimator and under the datasheet alpha-beta on `link`."""
    rows = ["| kind | n | size | XLA us | XLA GB/s | datasheet us | datasheet GB/s "
            "| XLA / datasheet time |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for s in sorted(comm, key=lambda s: (KINDS.index(s["kind"]), s["n"], s["bytes"])):
        ds = collective_time(s["kind"], s["bytes"], s["n"], link)
        rows.append(f"| {s['kind']} | {s['n']} | {_size(s['bytes'])} | {s['seconds'] * 1e6:.1f} | "
                    f"{s['bytes'] / s['seconds'] / 1e9:.1f} | {ds * 1e6:.1f} | "
                    f"{s['bytes'] / ds / 1e9:.1f} | {s['seconds'] / ds:.2f} |")
    return "\n".join(rows)


def gemm_table(gemm: list[dict], peak: Callable[[str], float]) -> str:
    """Markdown: XLA's GEMM prices beside the datasheet peak (`peak(dtype)` FLOP/s)."""
    rows = ["| m | n | k | dtype | chunks | XLA us | XLA TFLOP/s | at peak us |",
            "|---:|---:|---:|---|---:|---:|---:|---:|"]
    for s in gemm:
        flops = 2.0 * s["m"] * s["n"] * s["k"]
        rows.append(f"| {s['m']} | {s['n']} | {s['k']} | {s['dtype']} | {s['chunks']} | "
                    f"{s['seconds'] * 1e6:.1f} | {flops / s['seconds'] / 1e12:.0f} | "
                    f"{flops / peak(s['dtype']) * 1e6:.1f} |")
    return "\n".join(rows)
