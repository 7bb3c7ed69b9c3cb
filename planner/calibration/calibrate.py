"""Measure GEMMs and collectives on the local devices for a calibration profile
(scripts/calibrate.py), and print a profile as a table."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from oases_jax.errors import UserError
from oases_jax.hardware import detect
from oases_jax.mesh import make_mesh
from oases_jax.models.config import ModelConfig
from oases_jax.planner.calibration.profile import COMM_KINDS, Profile

GROUPS = ("all", "one")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CalibrationConfig:
    """What to measure. GEMM shapes are (m, k, n); collective sizes are bytes as in
    `oases_jax.hardware.collective_time`. groups="all" runs every device at once (GEMMs on
    each device, collectives in N/n groups of n), as a training step does; "one" runs one device
    / one group while the others idle."""

    gemm_shapes: tuple[tuple[int, int, int], ...]
    dtypes: tuple[str, ...]
    chunks: tuple[int, ...]
    kinds: tuple[str, ...]
    axis_sizes: tuple[int, ...]
    sizes: tuple[int, ...]
    repeats: int
    warmup: int
    groups: str = "all"
    min_program_s: float = 5e-3  # chained calls add at least this much to a program
    max_calls: int = 64
    # Bytes per device of the memory passes; larger than collectives', since below ~1 MiB a
    # pass costs its launch overhead and the fit cannot see the bandwidth.
    memory_sizes: tuple[int, ...] = (2**20, 2**22, 2**24, 2**26)

    def __post_init__(self):
        if self.groups not in GROUPS:
            raise UserError(f"groups {self.groups!r} is unknown; use one of {GROUPS}")
        if self.repeats < 1 or self.warmup < 0:
            raise UserError(f"repeats={self.repeats} must be >= 1 and warmup={self.warmup} >= 0")
        for kind in self.kinds:
            if kind not in COMM_KINDS:
                raise UserError(f"collective kind {kind!r} is unknown; use any of "
                                f"{','.join(COMM_KINDS)}")
        for dtype in self.dtypes:
            if dtype not in ("float32", "bfloat16"):
                raise UserError(f"dtype {dtype!r} is unknown; use float32 or bfloat16")
        for m, k, n in self.gemm_shapes:
            if min(m, k, n) <= 0:
                raise UserError(f"GEMM shape {m}x{k}x{n} needs positive sizes")
            bad = [c for c in self.chunks if c <= 0 or m % c]
            if bad:
                raise UserError(f"chunk counts {bad} do not divide the GEMM's m={m} "
                                f"(shape {m}x{k}x{n}); change --chunks or --tokens")
        if any(s <= 0 for s in self.sizes):
            raise UserError(f"collective sizes {self.sizes} must be positive")


def projection_shapes(model: ModelConfig, tokens: int,
                      tensor: int = 1) -> list[tuple[int, int, int]]:
    """The distinct (m, k, n) of a layer's projections on `tokens` rows: Q, K/V, output, MLP
    in (and gate) and out, as one device holds them under `tensor`-way Megatron parallelism
    (column-parallel n / tensor, row-parallel k / tensor; tensor=1 is unsharded)."""
    d, hk, gk, f = model.d_model, model.n_heads * model.k_dim, model.kv_heads * model.k_dim, \
        model.ff_dim
    for name, size in (("heads x head_dim", hk), ("kv_heads x head_dim", gk), ("d_ff", f)):
        if size % tensor:
            raise UserError(f"--tensor {tensor} does not divide the model's {name} ({size}); "
                            "pick a tensor degree that divides it")
    t = tensor
    shapes = [(tokens, d, hk // t), (tokens, d, gk // t), (tokens, hk // t, d),
              (tokens, d, f // t), (tokens, f // t, d)]
    return list(dict.fromkeys(shapes))


def byte_sizes(min_bytes: int, max_bytes: int) -> tuple[int, ...]:
    """min_bytes doubled up to max_bytes, and max_bytes itself."""
    if not 0 < min_bytes <= max_bytes:
        raise UserError(f"collective sizes need 0 < --min-bytes ({min_bytes}) <= --max-bytes "
                        f"({max_bytes})")
    sizes = [min_bytes]
    while sizes[-1] * 2 <= max_bytes:
        sizes.append(sizes[-1] * 2)
    return tuple(sizes) if sizes[-1] == max_bytes else (*sizes, max_bytes)


def default_axis_sizes(n_devices: int) -> tuple[int, ...]:
    """Powers of two from 2 to the device count that divide it."""
    return tuple(2**i for i in range(1, n_devices.bit_length()) if n_devices % 2**i == 0)


# Programs: `calls` calls in a chain. Each call's operand takes one element of the previous call's
# output, so XLA can neither merge the calls nor reorder them, at the cost of one element: XLA
# copies the operand once for the first call and then updates it in place.
def _after(operand, prev):
    first = prev.reshape(-1)[:1].astype(operand.dtype).reshape((1,) * operand.ndim)
    return lax.dynamic_update_slice(operand, first, (0,) * operand.ndim)


def _gemm_chain(chunks: int, calls: int) -> Callable:
    """`calls` chunked GEMMs, each `chunks` dependent GEMMs of (m/chunks) x k @ k x n, as a ring
    schedule runs them."""

    def chained(x_mk, w_kn):
        rows = x_mk.shape[0] // chunks
        out = None
        for _ in range(calls):
            for i in range(chunks):
                if out is not None:
                    w_kn = _after(w_kn, out)
                out = x_mk[i * rows:(i + 1) * rows] @ w_kn  # [m/chunks, n]
        return out

    return chained


def _collective_chain(kind: str, n: int, axis: str, calls: int) -> Callable:
    ring = [(j, (j + 1) % n) for j in range(n)]
    op = {
        "all-reduce": lambda x: lax.psum(x, axis),
        "all-gather": lambda x: lax.all_gather(x, axis, tiled=True),
        "reduce-scatter": lambda x: lax.psum_scatter(x, axis, tiled=True),
        "all-to-all": lambda x: lax.all_to_all(x, axis, 0, 0, tiled=True),
        "collective-permute": lambda x: lax.ppermute(x, axis, ring),
    }[kind]

    def chained(x):
        out = op(x)
        for _ in range(calls - 1):
            x = _after(x, out)
            out = op(x)
        return out

    return chained


def _norm_chain(calls: int) -> Callable:
    """`calls` dependent normalisations of x [rows, width] (mean, variance, scale, shift): one
    fused pass each that reads and writes x, as a layer's norms and residual adds do. The
    barrier between passes keeps XLA's GPU fusion from running the whole chain as one kernel
    that reads x once (row-wise passes chain without a grid-wide dependency)."""

    def chained(x):
        for i in range(calls):
            if i:
                x = lax.optimization_barrier(x)
            mean = x.mean(-1, keepdims=True)
            var = jnp.square(x - mean).mean(-1, keepdims=True)
            x = (x - mean) * lax.rsqrt(var + 1e-5) * 1.01 + 0.01
        return x

    return chained


def _filled(shape, dtype, sharding, seed: int = 0):
    make = jax.jit(lambda key: jax.random.normal(key, shape, dtype), out_shardings=sharding)
    return make(jax.random.key(seed))


def _run_time(fn, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def _time(chain: Callable[[int], Callable], mesh, in_specs, out_specs, args,
          cfg: CalibrationConfig) -> tuple[float, int]:
    """Seconds of one call, (t_K - t_1) / (K - 1), from the medians of programs of 1 and K chained
    calls (`chain(calls)` under shard_map) run in turn: the difference drops dispatch and the
    first call's copy. K makes the longer program run at least `min_program_s` longer."""

    def build(calls: int):
        f = jax.shard_map(chain(calls), mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        return jax.jit(f).lower(*args).compile()

    one = build(1)
    _run_time(one, args)
    probe = _run_time(one, args)
    calls = max(2, min(cfg.max_calls, 1 + math.ceil(cfg.min_program_s / max(probe, 1e-9))))
    many = build(calls)
    for _ in range(cfg.warmup):
        _run_time(one, args), _run_time(many, args)
    t_one, t_many = [], []
    for _ in range(cfg.repeats):
        t_one.append(_run_time(one, args))
        t_many.append(_run_time(many, args))
    t_one, t_many = statistics.median(t_one), statistics.median(t_many)
    per_call = (t_many - t_one) / (calls - 1)
    return (per_call if per_call > 0 else t_many / calls), calls  # noise: an upper bound


def measure_gemms(cfg: CalibrationConfig, log: Callable[[str], None]) -> list[dict]:
    P = jax.P
    devices = jax.devices() if cfg.groups == "all" else jax.devices()[:1]
    mesh = make_mesh(f"data={len(devices)}", devices)
    samples = []
    for dtype in cfg.dtypes:
        t0 = time.perf_counter()
        for m, k, n in cfg.gemm_shapes:
            x = _filled((m * len(devices), k), dtype, jax.NamedSharding(mesh, P("data")))
            w = _filled((k, n), dtype, jax.NamedSharding(mesh, P()), seed=1)
            for chunks in cfg.chunks:
                secs, calls = _time(functools.partial(_gemm_chain, chunks), mesh,
                                    (P("data"), P()), P("data"), (x, w), cfg)
                samples.append({"m": m, "n": n, "k": k, "dtype": dtype, "chunks": chunks,
                                "seconds": secs, "calls": calls})
        log(f"GEMMs {dtype}: {len(cfg.gemm_shapes)} shapes x {len(cfg.chunks)} chunk counts in "
            f"{time.perf_counter() - t0:.1f} s")
    return samples


def measure_collectives(cfg: CalibrationConfig, log: Callable[[str], None]) -> list[dict]:
    P = jax.P
    samples = []
    for n in cfg.axis_sizes:
        devices = jax.devices() if cfg.groups == "all" else jax.devices()[:n]
        mesh = make_mesh(f"data={len(devices) // n},tensor={n}", devices)
        spec = P(("data", "tensor"))
        for kind in cfg.kinds:
            t0 = time.perf_counter()
            for nbytes in cfg.sizes:
                elems = -(-nbytes // (4 * n * n)) * n * n  # whole blocks for all-to-all
                local = elems // n if kind == "all-gather" else elems  # gathered output = bytes
                x = jnp.zeros((local * len(devices),), jnp.float32,
                              device=jax.NamedSharding(mesh, spec))
                secs, calls = _time(functools.partial(_collective_chain, kind, n, "tensor"),
                                    mesh, spec, spec, (x,), cfg)
                samples.append({"kind": kind, "n": n, "bytes": elems * 4, "seconds": secs,
                                "calls": calls})
            log(f"{kind} over {n}: {len(cfg.sizes)} sizes in {time.perf_counter() - t0:.1f} s")
    return samples


def measure_memory(cfg: CalibrationConfig, log: Callable[[str], None],
                   width: int = 256) -> list[dict]:
    """Fused float32 normalisation passes over `cfg.memory_sizes` bytes per device (read +
    written),
    on every device at once (or one, with groups="one")."""
    P = jax.P
    devices = jax.devices() if cfg.groups == "all" else jax.devices()[:1]
    mesh = make_mesh(f"data={len(devices)}", devices)
    samples = []
    t0 = time.perf_counter()
    for nbytes in cfg.memory_sizes:
        rows = max(1, -(-nbytes // (2 * 4 * width)))
        x = _filled((rows * len(devices), width), "float32", jax.NamedSharding(mesh, P("data")))
        secs, calls = _time(_norm_chain, mesh, P("data"), P("data"), (x,), cfg)
        samples.append({"bytes": 2 * 4 * rows * width, "seconds": secs, "calls": calls})
    log(f"memory passes: {len(cfg.memory_sizes)} sizes in {time.perf_counter() - t0:.1f} s")
    return samples


def check_axis_sizes(cfg: CalibrationConfig, n_devices: int) -> None:
    for n in cfg.axis_sizes:
        if n < 2 or n > n_devices or (cfg.groups == "all" and n_devices % n):
            need = " and divide it (or pass --groups one)" if cfg.groups == "all" else ""
            raise UserError(f"axis size {n} must be between 2 and the device count "
                            f"{n_devices}{need}; change --axis-sizes")


def calibrate(cfg: CalibrationConfig, log: Callable[[str], None], *, device: str,
              meta: dict) -> Profile:
    check_axis_sizes(cfg, len(jax.devices()))
    gemm = measure_gemms(cfg, log)
    memory = measure_memory(cfg, log)
    comm = measure_collectives(cfg, log)
    meta = {**meta, "groups": cfg.groups, "repeats": cfg.repeats, "warmup": cfg.warmup}
    return Profile.from_samples(gemm, comm, source="profile", device=device,
                                n_devices=len(jax.devices()), meta=meta, memory_samples=memory)


def local_device_name() -> str:
    """The oases_jax.hardware name of the local devices ("cpu", "h100", ...), or else their
    device kind as a slug."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return "cpu"
    spec = detect(dev.device_kind)
    return spec.name if spec else "-".join(dev.device_kind.lower().split())


# Report.
def _kib(b: float) -> str:
    return f"{b / 2**20:.4g} MiB" if b >= 2**20 else f"{b / 2**10:.4g} KiB"


def format_table(prof: Profile) -> str:
    meta = prof.meta
    lines = [f"calibration profile: {prof.device} x {prof.n_devices} ({prof.source}; "
             f"groups: {meta.get('groups', '?')}; jax {meta.get('jax', '?')}; medians of "
             f"{meta.get('repeats', '?')}{_load(meta)})", ""]
    comm = prof.samples.get("comm", [])
    if prof.comm:
        lines += ["collectives: time = latency + bytes / bandwidth "
                  "(bytes as in hardware.collective_time)",
                  f"{'kind':<19} {'n':>3} {'GB/s':>8} {'latency us':>11}  {'sizes':<19} "
                  f"{'max err %':>9}"]
        for (kind, n), fit in sorted(prof.comm.items()):
            own = [s for s in comm if s["kind"] == kind and s["n"] == n]
            sizes = f"{_kib(min(s['bytes'] for s in own))}-{_kib(max(s['bytes'] for s in own))}"
            err = max(abs(prof.comm_time(kind, s["bytes"], n) / s["seconds"] - 1) for s in own)
            lines.append(f"{kind:<19} {n:>3} {fit.bytes_per_s / 1e9:>8.3f} "
                         f"{fit.latency_s * 1e6:>11.1f}  {sizes:<19} {100 * err:>9.1f}")
        lines.append("")
    if prof.memory is not None:
        own = prof.samples.get("memory", [])
        fit = prof.memory
        err = max((abs((fit.overhead_s + s["bytes"] / fit.bytes_per_s) / s["seconds"] - 1)
                   for s in own), default=0.0)
        lines += [f"memory passes (fused norm, read + write): {fit.bytes_per_s / 1e9:.3f} GB/s, "
                  f"overhead {fit.overhead_s * 1e6:.1f} us per pass, "
                  f"{_kib(min(s['bytes'] for s in own))}-{_kib(max(s['bytes'] for s in own))}, "
                  f"max err {100 * err:.1f} %", ""]
    gemm = prof.samples.get("gemm", [])
    for dtype, fit in sorted(prof.gemm.items()):
        own = [s for s in gemm if s["dtype"] == dtype]
        err = max(abs(prof.gemm_time(_flops(s), dtype, s["chunks"]) / s["seconds"] - 1)
                  for s in own)
        lines += [f"GEMMs {dtype}: time = chunks * overhead + FLOPs / rate; fitted "
                  f"{fit.flops_per_s / 1e9:.2f} GFLOP/s, overhead {fit.overhead_s * 1e6:.1f} us "
                  f"per call, max err {100 * err:.1f} %"]
        lines += _chunk_table(own)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _load(meta: dict) -> str:
    load = meta.get("load_average")
    return f"; host load {' -> '.join(f'{x:.1f}' for x in load)}" if load else ""


def _flops(s: dict) -> float:
    return 2.0 * s["m"] * s["n"] * s["k"]


def _chunk_table(samples: list[dict]) -> list[str]:
    """Measured GFLOP/s per shape and chunk count, and the median efficiency vs chunks=1."""
    chunks = sorted({s["chunks"] for s in samples})
    by = {((s["m"], s["k"], s["n"]), s["chunks"]): s["seconds"] for s in samples}
    shapes = list(dict.fromkeys(shape for shape, _ in by))
    head = f"{'m x k x n':<18}" + "".join(f"{f'chunks={c}':>11}" for c in chunks)
    rows = [f"{'GFLOP/s':<18}", head]
    for shape in shapes:
        cells = [by.get((shape, c)) for c in chunks]
        rows.append(f"{'x'.join(map(str, shape)):<18}" + "".join(
            f"{2 * math.prod(shape) / t / 1e9:>11.2f}" if t else f"{'-':>11}" for t in cells))
    eff = []
    for c in chunks:
        ratios = [by[(s, 1)] / by[(s, c)] for s in shapes if (s, 1) in by and (s, c) in by]
        eff.append(f"{statistics.median(ratios):>11.3f}" if ratios else f"{'-':>11}")
    rows.append(f"{'efficiency vs 1':<18}" + "".join(eff) + "  (median over shapes)")
    return rows
