"""Measured time of each op of a compiled train step beside the account's roofline
(`oases_jax.tools.analysis.fusions`): a few steps run under the JAX profiler, every traced op is
attributed to the HLO op it ran (the `hlo_op` each XLA kernel or thunk event carries) and summed
by the account's categories, so the roofline's opinion of each category stands next to what the
device spent on it.

Events: on a GPU the kernels on the first device's timeline; on CPU the thunks of the lowest
device ordinal (a CPU "device" is a thread pool, so its times say where host time goes, not what
a GPU would do). Events of ops the account does not cost (collectives, parameters) are reported
as unattributed.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import glob
import gzip
import json
import os
import re
import tempfile
from collections.abc import Callable, Iterable

from oases_jax.errors import UserError
from oases_jax.hardware import DeviceSpec
from oases_jax.tools.analysis import fusions
from oases_jax.tools.analysis.program import Program


def op_seconds(events: Iterable[dict], process_names: dict[int, str]) -> dict[str, float]:
    """Seconds per HLO op over the traced events of one device: a device timeline's events
    when the trace has one ("/device:..." processes; the first by name), named by their
    `hlo_op` or, lacking it, by the kernel's own name (XLA names a fusion's kernel after the
    fusion); else the host events with an `hlo_op` of the lowest `device_ordinal`."""
    events = [e for e in events if e.get("ph") == "X"]
    devices = sorted(n for n in process_names.values() if "/device:" in n)
    if devices:
        pids = {p for p, n in process_names.items() if n == devices[0]}
        out: dict[str, float] = collections.defaultdict(float)
        for e in events:
            if e.get("pid") in pids:
                op = (e.get("args") or {}).get("hlo_op") or ""
                if not op or op.startswith("command_buffer"):
                    # Inside a CUDA graph (an XLA command buffer) every kernel carries the
                    # buffer's name as its hlo_op; the kernel's own name is the fusion's.
                    op = e.get("name", "")
                out[op] += float(e.get("dur", 0.0)) * 1e-6
        return dict(out)
    events = [e for e in events if "hlo_op" in (e.get("args") or {})]
    ordinals = [int(e["args"]["device_ordinal"]) for e in events if "device_ordinal" in e["args"]]
    if ordinals:
        first = min(ordinals)
        events = [e for e in events if int(e["args"].get("device_ordinal", first)) == first]
    out = collections.defaultdict(float)
    for e in events:
        out[e["args"]["hlo_op"]] += float(e.get("dur", 0.0)) * 1e-6
    return dict(out)


# Library kernels that name no HLO op (in a command buffer, a cuBLAS GEMM is `nvjet_...` or
# `sm90_xmma_...`, cuDNN's attention `cudnn_generated_..._sdpa_...`): the category by the name.
_LIBRARY_KERNELS = (
    (re.compile(r"sdpa|flash|cudnn", re.I), "attention_kernel"),
    (re.compile(r"nvjet|gemm|xmma|cutlass|cublas", re.I), "gemm"),
    (re.compile(r"^(memcpy|memset)", re.I), "copy"),
)


def kernel_category(name: str) -> str | None:
    """The account's category of a library kernel known only by its name, or None."""
    for pattern, category in _LIBRARY_KERNELS:
        if pattern.search(name):
            return category
    return None


def _key(name: str) -> str:
    """An op's name as kernels spell it too ("loop_add_fusion.3" and "loop_add_fusion_3")."""
    return name.replace(".", "_").replace("-", "_")


def find_trace(trace_dir: str, flag: str = "the trace directory") -> str:
    """The newest Perfetto trace `jax.profiler.trace` wrote under `trace_dir`."""
    paths = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)
    if not paths:
        raise UserError(f"{flag} {trace_dir}: no profiler trace (*perfetto_trace.json.gz) under "
                        f"it; pass the directory bench.py --trace-dir wrote")
    return max(paths, key=os.path.getmtime)


def read_trace(trace_dir: str) -> tuple[list[dict], dict[int, str]]:
    """The events and process names of the Perfetto trace `jax.profiler.trace` wrote."""
    path = find_trace(trace_dir)
    try:
        with gzip.open(path) as f:
            trace = json.load(f)
    except (OSError, EOFError, ValueError) as e:
        raise UserError(f"profiler trace {path} is unreadable ({e}); profile again") from None
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return events, names


def measure(run_step: Callable[[], None], steps: int,
            trace_dir: str | None = None) -> dict[str, float]:
    """Seconds per step of each HLO op over `steps` calls of `run_step` under the profiler; the
    trace is kept under `trace_dir` when one is given (for Perfetto or TensorBoard)."""
    import jax

    with (contextlib.nullcontext(trace_dir) if trace_dir
          else tempfile.TemporaryDirectory()) as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(steps):
                run_step()
        events, names = read_trace(d)
    return {op: s / steps for op, s in op_seconds(events, names).items()}


@dataclasses.dataclass(frozen=True)
class Row:
    category: str
    roofline_s: float  # per step
    measured_s: float  # per step; 0 when the profiler saw none of its ops


def compare(program: Program, device: DeviceSpec, measured: dict[str, float]) -> dict:
    """The account by category with the measured seconds beside the roofline's: GEMMs and
    attention kernels as one row each, the non-GEMM categories, the measured seconds no costed
    op claims (`unattributed_s`), and the ten ops measured longest."""
    rows = fusions.account(program, device)
    by_name: dict[str, list[fusions.OpCost]] = collections.defaultdict(list)
    for r in rows:
        by_name[_key(r.name)].append(r)
    roof: dict[str, float] = collections.defaultdict(float)
    meas: dict[str, float] = collections.defaultdict(float)
    for r in rows:
        roof[r.category] += r.total_s
    claimed = 0.0
    category_of: dict[str, str] = {}
    for op, s in measured.items():
        costed = by_name.get(_key(op))
        category = costed[0].category if costed else kernel_category(op)
        if category is None:
            continue
        category_of[op] = category
        claimed += s
        meas[category] += s
    cats = sorted(roof, key=lambda c: -roof[c])
    cats += sorted(c for c in meas if c not in roof)
    top = sorted(((s, op) for op, s in measured.items() if op in category_of), reverse=True)[:10]
    return {
        "categories": [dataclasses.asdict(Row(c, roof.get(c, 0.0), meas.get(c, 0.0)))
                       for c in cats],
        "roofline_s": sum(roof.values()),
        "measured_s": sum(measured.values()),
        "unattributed_s": sum(measured.values()) - claimed,
        "top_measured": [{"op": op, "category": category_of[op], "measured_s": s,
                          "roofline_s": sum(r.total_s for r in by_name.get(_key(op), ()))}
                         for s, op in top],
    }


def traced(program: Program, device: DeviceSpec, trace_dir: str, steps: int) -> dict:
    """`compare` for a trace of `steps` steps of this program, profiled elsewhere (a GPU run's
    trace brought back beside a deviceless compile of the same program)."""
    events, names = read_trace(trace_dir)
    return compare(program, device, {op: s / steps for op, s in op_seconds(events, names).items()})


def local_device() -> DeviceSpec:
    """The datasheet of the devices at hand (the account's prices): a known GPU's, else the
    CPU's."""
    import jax

    from oases_jax.hardware import detect, get_cluster

    dev = jax.devices()[0]
    spec = detect(dev.device_kind) if dev.platform != "cpu" else None
    return spec or get_cluster("cpu-8").device_spec


def kept_dir(root: str | None, label: str) -> str | None:
    """Where a variant's trace is kept under `root` (bench.py --trace-dir; None: not kept)."""
    if root is None:
        return None
    path = os.path.join(root, re.sub(r"[^A-Za-z0-9._-]", "_", label))
    os.makedirs(path, exist_ok=True)
    return path


def for_variant(variant, steps: int, trace_dir: str | None = None) -> dict:
    """`compare` for a compiled bench variant (`tools.bench.Variant`), profiled over `steps`
    further steps of its own (the trace kept under `trace_dir` if given)."""
    program = Program(variant.step.as_text())
    return compare(program, local_device(), measure(variant.run_step, steps, trace_dir))


def format_table(label: str, report: dict) -> str:
    lines = [f"{label}: per step, roofline (our simulator's price) beside measured "
             f"(profiler, one device)",
             f"  {'category':<18}{'roofline ms':>12}{'measured ms':>13}{'measured/roof':>15}"]
    for r in report["categories"]:
        ratio = r["measured_s"] / r["roofline_s"] if r["roofline_s"] else float("nan")
        lines.append(f"  {r['category']:<18}{r['roofline_s'] * 1e3:>12.2f}"
                     f"{r['measured_s'] * 1e3:>13.2f}{ratio:>15.2f}")
    lines.append(f"  {'total':<18}{report['roofline_s'] * 1e3:>12.2f}"
                 f"{report['measured_s'] * 1e3:>13.2f}   (unattributed "
                 f"{report['unattributed_s'] * 1e3:.2f} ms)")
    lines.append("  longest measured ops: " + ", ".join(
        f"{t['op']} ({t['category']}) {t['measured_s'] * 1e3:.2f} ms" for t in
        report["top_measured"][:5]))
    return "\n".join(lines)
