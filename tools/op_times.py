"""Measured time of each op of a compiled train step beside the account's roofline
(`oases_jax.analysis.fusions`): a few steps run under the JAX profiler, every traced op is
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
import dataclasses
import glob
import gzip
import json
import tempfile
from collections.abc import Callable, Iterable

from oases_jax.analysis import fusions
from oases_jax.analysis.hardware import DeviceSpec
from oases_jax.analysis.program import Program


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
                op = (e.get("args") or {}).get("hlo_op") or e.get("name", "")
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


def _key(name: str) -> str:
    """An op's name as kernels spell it too ("loop_add_fusion.3" and "loop_add_fusion_3")."""
    return name.replace(".", "_").replace("-", "_")


def read_trace(trace_dir: str) -> tuple[list[dict], dict[int, str]]:
    """The events and process names of the Perfetto trace `jax.profiler.trace` wrote."""
    paths = glob.glob(f"{trace_dir}/**/*perfetto_trace.json.gz", recursive=True)
    if not paths:
        raise RuntimeError(f"the profiler wrote no Perfetto trace under {trace_dir}")
    with gzip.open(paths[0]) as f:
        trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    names = {e["pid"]: e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    return events, names


def measure(run_step: Callable[[], None], steps: int) -> dict[str, float]:
    """Seconds per step of each HLO op over `steps` calls of `run_step` under the profiler."""
    import jax

    with tempfile.TemporaryDirectory() as d:
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
    for op, s in measured.items():
        costed = by_name.get(_key(op))
        if not costed:
            continue
        claimed += s
        meas[costed[0].category] += s
    cats = sorted(roof, key=lambda c: -roof[c])
    top = sorted(((s, op) for op, s in measured.items() if _key(op) in by_name),
                 reverse=True)[:10]
    return {
        "categories": [dataclasses.asdict(Row(c, roof[c], meas.get(c, 0.0))) for c in cats],
        "roofline_s": sum(roof.values()),
        "measured_s": sum(measured.values()),
        "unattributed_s": sum(measured.values()) - claimed,
        "top_measured": [{"op": op, "category": by_name[_key(op)][0].category,
                          "measured_s": s,
                          "roofline_s": sum(r.total_s for r in by_name[_key(op)])}
                         for s, op in top],
    }


def local_device() -> DeviceSpec:
    """The datasheet of the devices at hand (the account's prices): a known GPU's, else the
    CPU's."""
    import jax

    from oases_jax.analysis.hardware import detect, get_cluster

    dev = jax.devices()[0]
    spec = detect(dev.device_kind) if dev.platform != "cpu" else None
    return spec or get_cluster("cpu-8").device_spec


def for_variant(variant, steps: int) -> dict:
    """`compare` for a compiled bench variant (`tools.bench.Variant`), profiled over `steps`
    further steps of its own."""
    program = Program(variant.step.as_text())
    return compare(program, local_device(), measure(variant.run_step, steps))


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
