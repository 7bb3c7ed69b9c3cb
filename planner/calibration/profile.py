"""Calibration profiles: GEMM and collective costs measured on real devices (scripts/calibrate.py),
fitted to two-parameter lines, which the cost model prefers over datasheet numbers."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from collections.abc import Iterable
from typing import Annotated

import numpy as np
from pydantic import ConfigDict, Field

from oases_jax.cli import write_atomic
from oases_jax.errors import UserError
from oases_jax.files import read_json
from oases_jax.schema import (
    MAX_DEVICES,
    NonNegativeFloat,
    PositiveFloat,
    Strict,
    Text,
    at_most,
    exactly,
    one_of,
    validate,
)

FORMAT = "oases-jax-profile"
VERSION = 1
SOURCES = ("profile", "xla")
COMM_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
# The source checkout (or, installed, the `oases_jax` package directory): the committed profiles
# are in its `planner/profiles/`, shipped as package data of `oases_jax.planner`.
ROOT = pathlib.Path(__file__).resolve().parents[2]


def default_profile_path(device: str, n_devices: int) -> pathlib.Path:
    """Where `--plan auto` looks for the profile of `n_devices` devices named `device`."""
    return ROOT / "planner" / "profiles" / f"{device}-{n_devices}.json"


def default_profile_out(device: str, n_devices: int) -> pathlib.Path:
    """Where scripts/calibrate.py writes without --out: `default_profile_path` in a source
    checkout; an installed package's own directory is never written into."""
    installed = {"site-packages", "dist-packages"} & set(ROOT.parts)
    if installed or not (ROOT / "pyproject.toml").is_file():
        raise UserError(f"the planner is installed in {str(ROOT)!r}, not a source checkout, and "
                        "calibrate.py does not write into an installed package; pass --out FILE "
                        "(and --profile FILE to plan.py)")
    return default_profile_path(device, n_devices)


@dataclasses.dataclass(frozen=True)
class GemmFit:
    """One GEMM call: time = overhead_s + flops / flops_per_s."""

    flops_per_s: float
    overhead_s: float


@dataclasses.dataclass(frozen=True)
class CommFit:
    """One collective call: time = latency_s + nbytes / bytes_per_s (bytes as in
    `oases_jax.hardware.collective_time`). bytes_per_s is inf when the measured times
    did not grow with size."""

    bytes_per_s: float
    latency_s: float


@dataclasses.dataclass(frozen=True)
class MemFit:
    """One memory-bound (elementwise or row-reduction) pass: time = overhead_s + nbytes /
    bytes_per_s, nbytes read plus written."""

    bytes_per_s: float
    overhead_s: float


@dataclasses.dataclass
class Profile:
    """Fitted costs of one set of devices, plus the raw samples they were fitted to.

    Gemm sample: {"m", "n", "k", "dtype", "chunks", "seconds"}: `chunks` calls of an
    (m/chunks) x k @ k x n GEMM took `seconds` in all. Comm sample: {"kind", "n", "bytes",
    "seconds"}: one collective over a group of n devices. Memory sample: {"bytes", "seconds"}:
    one fused normalisation pass reading and writing `bytes` in all (optional: profiles made
    before it was measured have none, and the cost model falls back to the datasheet).
    """

    source: str  # "profile" (measured on devices) or "xla" (XLA's estimator)
    device: str  # an oases_jax.hardware device name, e.g. "cpu", "h100"
    n_devices: int
    gemm: dict[str, GemmFit]  # by dtype name
    comm: dict[tuple[str, int], CommFit]  # (kind, group size) -> fit
    samples: dict  # {"gemm": [...], "comm": [...], "memory": [...]}
    meta: dict  # command, date, jax version, host
    memory: MemFit | None = None

    def gemm_time(self, flops: float, dtype: str, chunks: int = 1) -> float | None:
        """chunks * overhead + flops / rate: `chunks` calls of flops/chunks each; None when
        `dtype` was not profiled."""
        fit = self.gemm.get(dtype)
        if fit is None:
            return None
        if flops <= 0:
            return 0.0
        return chunks * fit.overhead_s + flops / fit.flops_per_s

    def comm_time(self, kind: str, nbytes: float, n: int) -> float | None:
        """latency + bytes / bandwidth of the (kind, n) fit; 0 for n <= 1 or no bytes (as
        `collective_time`); None when (kind, n) was not profiled."""
        if n <= 1 or nbytes == 0:
            return 0.0
        fit = self.comm.get((kind, n))
        if fit is None:
            return None
        return fit.latency_s + nbytes / fit.bytes_per_s

    def mem_time(self, nbytes: float) -> float | None:
        """overhead + bytes / bandwidth of the memory fit; None without one. The overhead is
        per pass; the cost model prices lumped passes, so it adds the bandwidth term only."""
        if self.memory is None:
            return None
        return nbytes / self.memory.bytes_per_s

    def covers(self, kind: str, n: int) -> bool:
        return (kind, n) in self.comm

    def coverage(self) -> dict[str, list[int]]:
        """The profiled group sizes of each collective kind, e.g. {"all-reduce": [2, 4, 8]}."""
        out: dict[str, list[int]] = {}
        for kind, n in sorted(self.comm):
            out.setdefault(kind, []).append(n)
        return out

    # JSON.
    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "version": VERSION,
            "source": self.source,
            "device": self.device,
            "n_devices": self.n_devices,
            "gemm": {dt: dataclasses.asdict(f) for dt, f in sorted(self.gemm.items())},
            "comm": [
                {"kind": kind, "n": n, "bytes_per_s": _finite_or_none(f.bytes_per_s),
                 "latency_s": f.latency_s}
                for (kind, n), f in sorted(self.comm.items())
            ],
            "memory": dataclasses.asdict(self.memory) if self.memory else None,
            "samples": self.samples,
            "meta": self.meta,
        }

    @classmethod
    def from_json(cls, d: object, where: str = "calibration profile") -> Profile:
        """A profile from its parsed JSON, validated (`ProfileFile`): one UserError line naming
        the field, the value and the fix for whatever is wrong."""
        p = validate(ProfileFile, d, where=where, kind="calibration profile", fix=PROFILE_FIX)
        comm: dict[tuple[str, int], CommFit] = {}
        for i, c in enumerate(p.comm):
            if (c.kind, c.n) in comm:
                raise UserError(f"{where}: comm[{i}] repeats the fit of {c.kind} over {c.n} "
                                f"devices; keep one; {PROFILE_FIX}")
            if c.n > p.n_devices:
                raise UserError(f"{where}: comm[{i}].n = {c.n} is more than n_devices="
                                f"{p.n_devices}; {PROFILE_FIX}")
            comm[(c.kind, c.n)] = CommFit(_none_to_inf(c.bytes_per_s), c.latency_s)
        prof = cls(source=p.source, device=p.device, n_devices=p.n_devices,
                   gemm={dt: GemmFit(f.flops_per_s, f.overhead_s) for dt, f in p.gemm.items()},
                   comm=comm, samples=dict(d.get("samples") or {}),
                   meta=dict(d.get("meta") or {}),
                   memory=MemFit(p.memory.bytes_per_s, p.memory.overhead_s) if p.memory else None)
        prof._validate()
        return prof

    def save(self, path) -> None:
        write_atomic(str(path), json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> Profile:
        """Read and validate a profile file (`oases_jax.files.read_json`, `from_json`)."""
        data = read_json(path, "calibration profile",
                         f"make it with `python scripts/calibrate.py --out {path}`")
        return cls.from_json(data, f"calibration profile {str(path)!r}")

    # Fitting.
    @classmethod
    def from_samples(cls, gemm_samples: Iterable[dict], comm_samples: Iterable[dict], *,
                     source: str, device: str, n_devices: int, meta: dict | None = None,
                     memory_samples: Iterable[dict] = ()) -> Profile:
        """Least-squares fits, with non-negative parameters, minimising relative error:

        GEMM, per dtype over every shape and chunk count:
            seconds = chunks * overhead_s + 2 m n k / flops_per_s
        collective, per (kind, n):
            seconds = latency_s + bytes / bytes_per_s
        memory pass (if sampled):
            seconds = overhead_s + bytes / bytes_per_s
        """
        gemm_samples, comm_samples = list(gemm_samples), list(comm_samples)
        memory_samples = list(memory_samples)
        memory = None
        if memory_samples:
            rows = [(*_fields(s, ("bytes",), "memory"), 1.0, *_fields(s, ("seconds",), "memory"))
                    for s in memory_samples]
            inv_bw, overhead = _fit(rows, "memory passes")
            if inv_bw == 0:
                raise UserError("memory pass times do not grow with bytes; measure larger sizes")
            memory = MemFit(bytes_per_s=1.0 / inv_bw, overhead_s=overhead)
        gemm_rows: dict[str, list] = {}
        for s in gemm_samples:
            m, n, k, chunks, secs = _fields(s, ("m", "n", "k", "chunks", "seconds"), "gemm")
            dtype = _name(s, "dtype", "gemm")
            gemm_rows.setdefault(dtype, []).append((2.0 * m * n * k, chunks, secs))
        comm_rows: dict[tuple[str, int], list] = {}
        for s in comm_samples:
            n, nbytes, secs = _fields(s, ("n", "bytes", "seconds"), "comm")
            kind = _name(s, "kind", "comm")
            if kind not in COMM_KINDS:
                raise UserError(f"comm sample kind {kind!r} is unknown; use one of "
                                f"{', '.join(COMM_KINDS)}")
            comm_rows.setdefault((kind, int(n)), []).append((nbytes, 1.0, secs))
        gemm = {}
        for dtype, rows in gemm_rows.items():
            inv_rate, overhead = _fit(rows, f"GEMMs of {dtype}")
            if inv_rate == 0:
                raise UserError(f"GEMM times of {dtype} do not grow with FLOPs; measure larger "
                                "shapes")
            gemm[dtype] = GemmFit(flops_per_s=1.0 / inv_rate, overhead_s=overhead)
        comm = {}
        for (kind, n), rows in comm_rows.items():
            inv_bw, latency = _fit(rows, f"{kind} over {n} devices")
            comm[(kind, n)] = CommFit(bytes_per_s=1.0 / inv_bw if inv_bw else math.inf,
                                      latency_s=latency)
        samples = {"gemm": gemm_samples, "comm": comm_samples}
        if memory_samples:
            samples["memory"] = memory_samples
        prof = cls(source=source, device=device, n_devices=n_devices, gemm=gemm, comm=comm,
                   samples=samples, meta=dict(meta or {}), memory=memory)
        prof._validate()
        return prof

    def _validate(self) -> None:
        if self.source not in SOURCES:
            raise UserError(f"profile source {self.source!r} is unknown; use one of {SOURCES}")
        if self.n_devices <= 0:
            raise UserError(f"profile n_devices={self.n_devices} must be positive")
        for dt, f in self.gemm.items():
            if not (f.flops_per_s > 0 and math.isfinite(f.flops_per_s) and f.overhead_s >= 0):
                raise UserError(f"GEMM fit of {dt} {f} needs a finite positive rate and a "
                                "non-negative overhead")
        if self.memory is not None and not (self.memory.bytes_per_s > 0
                                            and math.isfinite(self.memory.bytes_per_s)
                                            and self.memory.overhead_s >= 0):
            raise UserError(f"memory fit {self.memory} needs a finite positive bandwidth and a "
                            "non-negative overhead")
        for (kind, n), f in self.comm.items():
            if kind not in COMM_KINDS or n < 2:
                raise UserError(f"collective fit ({kind!r}, {n}) needs a kind of "
                                f"{', '.join(COMM_KINDS)} and a group of 2 or more")
            if not (f.bytes_per_s > 0 and f.latency_s >= 0):
                raise UserError(f"collective fit ({kind}, {n}) {f} needs a positive bandwidth "
                                "and a non-negative latency")


PROFILE_FIX = "re-run scripts/calibrate.py (the format: docs/planner.md, \"The file\")"


class GemmEntry(Strict):
    flops_per_s: PositiveFloat
    overhead_s: NonNegativeFloat


class CommEntry(Strict):
    kind: one_of(COMM_KINDS, "collective")
    n: Annotated[int, Field(ge=2, le=MAX_DEVICES)]
    bytes_per_s: PositiveFloat | None  # null: times did not grow with size (infinite)
    latency_s: NonNegativeFloat


class MemEntry(Strict):
    bytes_per_s: PositiveFloat
    overhead_s: NonNegativeFloat


class _Sample(Strict):
    model_config = ConfigDict(extra="allow")  # measurement details (calls, dtype) ride along
    seconds: PositiveFloat


class GemmSample(_Sample):
    m: PositiveFloat
    n: PositiveFloat
    k: PositiveFloat
    dtype: Text
    chunks: PositiveFloat


class CommSample(_Sample):
    kind: one_of(COMM_KINDS, "collective")
    n: PositiveFloat
    bytes: PositiveFloat


class MemSample(_Sample):
    bytes: PositiveFloat


class Samples(Strict):
    gemm: list[GemmSample] = []
    comm: list[CommSample] = []
    memory: list[MemSample] = []


class ProfileFile(Strict):
    """A calibration profile file (`Profile.to_json`)."""

    format: exactly(FORMAT, "format")
    version: exactly(VERSION, "version")
    source: one_of(SOURCES, "profile source")
    device: Text
    n_devices: at_most(MAX_DEVICES)
    gemm: dict[Text, GemmEntry]
    comm: list[CommEntry]
    memory: MemEntry | None = None  # null: not measured (the cost model uses the datasheet)
    samples: Samples = None
    meta: dict = None


def _fields(sample: dict, keys: tuple[str, ...], what: str) -> list[float]:
    try:
        values = [float(sample[k]) for k in keys]  # TypeError too when sample is no dict
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{what} sample {sample!r} lacks a numeric {e}; it needs keys "
                        f"{', '.join(keys)}") from None
    if not all(v > 0 and math.isfinite(v) for v in values):
        raise UserError(f"{what} sample {sample!r} needs positive finite {', '.join(keys)}")
    return values


def _name(sample: dict, key: str, what: str) -> str:
    value = sample.get(key) if isinstance(sample, dict) else None
    if not isinstance(value, str):
        raise UserError(f"{what} sample {sample!r} needs a string {key!r}")
    return value


def _fit(rows: list[tuple[float, float, float]], what: str) -> tuple[float, float]:
    """Non-negative (a, b) minimising sum(((a x + b c) - t) / t)^2 over rows (x, c, t).

    Two unknowns: the constrained optimum is the unconstrained one, or else the better of the
    two one-parameter fits on the boundary (a = 0 or b = 0).
    """
    rows_ = np.asarray(rows, dtype=np.float64)
    design = rows_[:, :2] / rows_[:, 2:3]
    target = np.ones(len(rows_))
    if np.linalg.matrix_rank(design) < 2:
        raise UserError(f"cannot fit {what}: it needs samples of at least two sizes "
                        "(and for GEMMs, a size or chunk count that differs)")
    sol = np.linalg.lstsq(design, target, rcond=None)[0]
    if (sol >= 0).all():
        return float(sol[0]), float(sol[1])
    best = None
    for j in (0, 1):
        col = design[:, j]
        coef = max(0.0, float(col @ target / (col @ col)))
        resid = float(np.sum((col * coef - target) ** 2))
        if best is None or resid < best[0]:
            best = (resid, (coef, 0.0) if j == 0 else (0.0, coef))
    return best[1]


def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _none_to_inf(x) -> float:
    return math.inf if x is None else float(x)
