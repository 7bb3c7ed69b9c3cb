"""Compiling a GPU program with XLA's latency-hiding schedule dump on, and reading XLA's estimate
back from it (`xla_estimate` composes it), with cuDNN's fused attention priced from its shapes."""

from __future__ import annotations

import contextlib
import pathlib
import re
import shutil
import tempfile
import warnings
from collections.abc import Iterator

import jax

from oases_jax.hardware import DeviceSpec, detect
from oases_jax.tools.analysis.attention import FUSED_ATTENTION_PREFIX
from oases_jax.tools.analysis.program import Program
from oases_jax.tools.analysis.simulate import roofline_time
from oases_jax.tools.analysis.xla_estimate import (
    XlaEstimate,
    estimate_from_hlo_text,
    estimate_from_schedule,
)

# Per-compile options that make XLA write `<module>.schedule.txt` and fill each instruction's
# `reification_cost` (the "sol" entry is what the scheduler uses). `xla_dump_to` is added per call.
DUMP_OPTIONS = {"xla_dump_latency_hiding_schedule": True, "xla_gpu_collect_cost_model_stats": True}


@contextlib.contextmanager
def xla_dump(options: dict) -> Iterator[tuple[dict, pathlib.Path]]:
    """Compiler options that make XLA dump what `options` ask for into a fresh directory,
    removed on exit (errors included): `with xla_dump(opts) as (options, where):
    lowered.compile(compiler_options={**mine, **options})`, then read `where`."""
    where = pathlib.Path(tempfile.mkdtemp(prefix="oases-xla-dump-"))
    try:
        yield {"xla_dump_to": str(where), **options}, where
    finally:
        shutil.rmtree(where, ignore_errors=True)


def schedule_dump():
    """`xla_dump` of the schedule (`DUMP_OPTIONS`), read back by `read_dump(where)`."""
    return xla_dump(DUMP_OPTIONS)


def schedule_files(where: pathlib.Path) -> list[pathlib.Path]:
    return sorted(where.glob("*.schedule.txt"))


def read_dump(where: pathlib.Path, compiled_text: str | None = None,
              prices: dict[str, float] | None = None) -> XlaEstimate:
    """The estimate from a dump directory holding one compiled module. Without a schedule file
    (nothing was asynchronous, so the scheduler had nothing to schedule) it is composed from
    `compiled_text`, the compiled HLO, which carries the same "sol" prices. `prices` (seconds by
    instruction name, e.g. `fused_attention_prices`) replace XLA's."""
    files = schedule_files(where)
    if len(files) > 1 and compiled_text:  # the compiled module's own schedule
        name = re.match(r"HloModule (\S+?),", compiled_text)
        files = [f for f in files if name and f.name == f"{name.group(1)}.schedule.txt"] or files
    if len(files) > 1:
        raise ValueError(f"dump {where} holds {len(files)} schedules; compile one module per dump")
    if files:
        return estimate_from_schedule(files[0].read_text(), prices=prices)
    if compiled_text is None:
        raise ValueError(f"dump {where} holds no *.schedule.txt and no compiled HLO was given")
    if re.search(r"(?:async|all-reduce|all-gather|collective-permute)-start\(", compiled_text):
        raise ValueError(
            "the compiled program has asynchronous collectives but XLA wrote no schedule dump: "
            "a persistent compilation-cache hit skips the compiler; compile with "
            "jax.config.update('jax_enable_compilation_cache', False)")
    return estimate_from_hlo_text(compiled_text, prices=prices)


def compile_with_estimate(lowered, compiler_options: dict | None = None,
                          device: DeviceSpec | None = None, on_dump=None):
    """`lowered.compile(...)` with the schedule dump on, for a GPU target: (compiled, estimate).
    cuDNN's fused-attention calls are priced at the roofline of `device` (by default the
    compiled program's own devices, `compiled_device`) instead of XLA's flat 10 us. The dump
    directory is removed before this returns or raises; `on_dump(directory)` may read what else
    the options dumped there first (e.g. `memory_report`). An XLA that refuses the dump options
    (no schedule tables for the device, e.g. sm_86) gets a compile without them, still dumping
    into a directory for `on_dump`, and the estimate is None (a warning says why)."""
    with schedule_dump() as (options, where):
        try:
            compiled = lowered.compile(compiler_options={**(compiler_options or {}), **options})
        except Exception as e:  # retried without the schedule dump; a genuine failure raises
            # again. What the caller's own options dump (e.g. the memory report) still goes to
            # a directory of its own, never to stdout and the working directory.
            warnings.warn(f"XLA's schedule dump is unavailable ({str(e)[:200]}); "
                          "no XLA estimate", stacklevel=2)
            if on_dump is None:
                return lowered.compile(compiler_options=compiler_options or {}), None
            with xla_dump({}) as (plain, own):
                compiled = lowered.compile(compiler_options={**(compiler_options or {}), **plain})
                on_dump(own)
            return compiled, None
        text = compiled.as_text()
        if on_dump is not None:
            on_dump(where)
        device = device or compiled_device(compiled)
        prices = None
        if FUSED_ATTENTION_PREFIX in text:
            if device is not None:
                prices = fused_attention_prices(Program(text), device)
            else:
                warnings.warn("no datasheet for the compiled program's devices: XLA's estimate "
                              "keeps its flat 10 us per fused-attention call", stacklevel=2)
        return compiled, read_dump(where, text, prices)


def compiled_device(compiled) -> DeviceSpec | None:
    """The datasheet of the devices a compiled program is for (`hardware.detect` on their
    kind), or None."""
    try:
        shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    except Exception:  # a program with no shardings to read
        return None
    for sharding in shardings:
        devices = getattr(sharding, "device_set", None)
        if devices:
            return detect(next(iter(devices)).device_kind)
    return None


def fused_attention_prices(program: Program, device: DeviceSpec) -> dict[str, float]:
    """Seconds of each of cuDNN's fused-attention calls at the simulator's roofline
    (`simulate.roofline_time`: the FLOPs of `attention.fused_attention_flops` at the device's
    peak, or its operands and outputs at HBM bandwidth), by instruction name and by
    `scheduling_name` (the name XLA's schedule dump knows it by)."""
    out = {}
    for comp, instr, _ in program.fused_attention_calls():
        seconds = roofline_time(program, comp, instr, device)
        out[instr.name] = seconds
        m = re.search(r'scheduling_name="([^"]+)"', instr.attrs)
        if m:
            out[m.group(1)] = seconds
    return out
