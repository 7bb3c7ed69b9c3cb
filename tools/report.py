"""Human-readable reports of inspections: collective tables, memory, simulated times, timelines."""

from __future__ import annotations

import collections
import pathlib
from typing import Annotated

from pydantic import ConfigDict, Field

from oases_jax.files import read_json
from oases_jax.schema import NonNegativeFloat, Strict, Text, validate

MIB = 2**20


def _fmt_s(s: float) -> str:
    return f"{s * 1e3:9.3f} ms"


def collective_table(r: dict) -> str:
    """One row per (kind, axes, bytes, async, overlap) group, with execution counts."""
    rows = collections.Counter()
    for c in r["collectives"]:
        key = (c["kind"], ",".join(c["axes"]) or "-", c["bytes"],
               "async" if c["is_async"] else "sync",
               "gemm" if c["gemm_overlapped"] else "compute" if c["overlapped"] else "none")
        rows[key] += c["count"]
    lines = [f"{'collective':<20} {'axes':<12} {'MiB':>9} {'count':>6} {'mode':<6} overlap"]
    for (kind, axes, nbytes, mode, overlap), n in sorted(rows.items(), key=lambda kv: -kv[0][2]):
        lines.append(f"{kind:<20} {axes:<12} {nbytes / MIB:9.3f} {n:6d} {mode:<6} {overlap}")
    return "\n".join(lines)


def summary(r: dict) -> str:
    if "error" in r:
        return f"schedule {r['schedule']} on {r['target']}: FAILED: {r['error']}"
    mem = r["memory"]
    micro = r.get("microbatches", 1)
    parts = [
        f"target {r['target']}  mesh {r['mesh']}  rules {r['rules']}  schedule {r['schedule']}"
        f"  {'layer' if r['layer'] else 'train step'}  batch {r['batch_size']} x {r['seq_len']}"
        + (f" in {micro} micro-batches" if micro > 1 else ""),
        *([f"layers: {layers_label(r['layers'])}"] if r.get("layers") else []),
        "",
        collective_table(r),
        "",
        f"overlap share (bytes with compute in window): {r['overlap_share']:.3f}"
        f"   with a GEMM in window: {r['gemm_overlap_share']:.3f}",
        *by_kind_line(r),
        f"memory per device: peak {mem.get('peak_bytes', 0) / MIB:.1f} MiB = arguments "
        f"{mem.get('argument', 0) / MIB:.1f} + outputs {mem.get('output', 0) / MIB:.1f} - aliased "
        f"{mem.get('alias', 0) / MIB:.1f} + temporaries {mem.get('temp', 0) / MIB:.1f}",
        f"FLOPs per device: {r['flops'] / 1e12:.3f} TFLOP",
        *attention_lines(r),
        *moe_lines(r),
        f"simulated on {r['cluster']}: step {_fmt_s(r['simulated_step_s'])}, compute "
        f"{_fmt_s(r['compute_s'])}, comm {_fmt_s(r['comm_s'])}, exposed comm "
        f"{_fmt_s(r['exposed_comm_s'])}",
        *schedule_costs_lines(r),
        *hidden_lines(r),
        *pipeline_lines(r),
        *planner_lines(r),
        *xla_lines(r),
        f"compile time: {r['compile_s']:.1f} s",
    ]
    return "\n".join(parts)


def pipeline_lines(r: dict) -> list[str]:
    """A pipelined program's tick loop, priced per branch and stage
    (`oases_jax.tools.analysis.pipeline_time`): the simulated step above replays each tick's
    conditional by its first branch, this one by what each stage runs."""
    p = r.get("pipeline")
    if not p:
        return []
    if "error" in p:
        return [f"pipeline: {p['error']}"]
    ev = p["events"]
    pct = lambda xs: ", ".join(f"{x:.1%}" for x in xs)  # noqa: E731
    branches = ", ".join(f"{b['kind']}{b['virtual_stage']} {b['step_s'] * 1e3:.2f}"
                         for b in p["branches"][1:])
    return [
        f"pipeline {p['schedule']} S={p['stages']} M={p['microbatches']}, {p['ticks']} "
        f"{'fused ticks of ' + str(p['lanes']) + ' lanes' if p.get('lanes', 1) > 1 else 'ticks'}: "
        f"step {_fmt_s(p['step_s'])} = outside the loop {_fmt_s(p['outside_s'])} + loop "
        f"{_fmt_s(p['loop_s'])}",
        f"  branches (ms): {branches}; rest of a tick {p['rest_s'] * 1e3:.3f} ms"
        + (f"; split head {p['head_phase_s'] * 1e3:.3f} ms (comm "
           f"{p['head_phase_comm_s'] * 1e3:.3f}) after {p['head_phases']} ticks"
           if p.get("head_phases") else ""),
        f"  idle per stage {pct(p['idle_fraction'])} (bubble {p['bubble']:.1%}), recompute "
        f"{p['recompute_share']:.1%}, permutes {_fmt_s(p['permute_s'])}, exposed comm "
        f"{_fmt_s(p['exposed_comm_s'])}",
        f"  event model (stages run ahead): {_fmt_s(ev['makespan_s'])}, idle per stage "
        f"{pct(ev['idle_fraction'])}; lockstep {_fmt_s(ev['lockstep_s'])} vs switch time "
        f"{_fmt_s(p['switch_s'])}",
        *stage_lines(p.get("per_stage")),
    ]


def stage_lines(st: dict | None) -> list[str]:
    """A pipelined program's per-stage account (`analysis.pipeline_stages`): recompute FLOPs
    over forward FLOPs, and the activation bytes each stage's slots hold against the pools
    every device allocates."""
    if not st:
        return []
    if "error" in st:
        return [f"  per stage: {st['error']}"]
    f, m = st["flops"], st["memory"]
    mib = lambda xs: ", ".join(f"{x / MIB:.1f}" for x in xs)  # noqa: E731
    ratios = st.get("remat_ratios")
    return [
        "  recompute FLOPs / forward FLOPs per stage: "
        + ", ".join(f"{x:.1%}" for x in f["recompute_ratio"])
        + (f" (--remat-ratios {', '.join(f'{r:g}' for r in ratios)})" if ratios else ""),
        f"  activations per stage (MiB): held {mib(m['held_bytes'])}; pools allocated on every "
        f"device {m['pool_bytes'] / MIB:.1f}; peak per stage {mib(m['stage_peak_bytes'])} "
        f"(XLA's peak {m['peak_bytes'] / MIB:.1f} - pools + held)",
    ]


def moe_lines(r: dict) -> list[str]:
    """An MoE program's collectives by kind and axis (per step and per MoE layer, forward and
    backward together) and, where the schedule chunks them, whether each chunk's ESP
    all-gather runs beside the next chunk's all-to-all (`oases_jax.tools.analysis.moe_program`)."""
    moe = r.get("moe")
    if not moe:
        return []
    chunks = r.get("moe_chunks")
    out = [f"MoE (MoE layers: {moe['n_moe_layers']}, --moe-schedule {r.get('moe_schedule')}"
           + (f", {chunks} chunks" if chunks else "") + "): per step / per MoE layer"]
    for key, row in moe["collectives"].items():
        sizes = ", ".join(f"{b / MIB:.3f}" for b in row["sizes"])
        out.append(f"  {key:<28} {row['count']:4d} x {sizes} MiB = {row['bytes'] / MIB:.2f} MiB"
                   f" / {moe['per_layer_bytes'][key] / MIB:.2f} MiB")
    for side, what in (("dispatch_pipelines", "all-gather of chunk i beside the all-to-all of "
                        "chunk i+1"), ("combine_pipelines", "all-to-all back of chunk i beside "
                                       "the reduce-scatter of chunk i+1")):
        for p in moe[side]:
            ok = sum(p["overlapped"])
            out.append(f"  chunks ({p['computation']}): {what}: {ok}/{len(p['overlapped'])} "
                       f"pairs overlap ({p['chunks']} chunks)")
    return out


def attention_lines(r: dict) -> list[str]:
    """Which attention the compiled program holds (`attention_kernel`)."""
    kernel = r.get("attention_kernel")
    if kernel is None:
        return []
    what = {"cudnn_flash": "cuDNN's fused flash kernel, no scores in memory",
            "materialised": "materialised scores ([B, H, L, L] GEMMs and softmax)",
            "none": "no attention found"}.get(kernel, kernel)
    return [f"attention: {kernel} ({what})"]


def by_kind_line(r: dict) -> list[str]:
    """The GEMM-in-window share of each collective kind, when there is more than one kind."""
    shares = r.get("gemm_overlap_share_by_kind") or {}
    if len(shares) < 2:
        return []
    return ["  with a GEMM in window, by kind: "
            + ", ".join(f"{kind} {share:.3f}" for kind, share in shares.items())]


def layers_label(layers: list[dict]) -> str:
    """Runs of equal consecutive layers: `2 x oases/2+none, 1 x megatron+full`."""
    runs: list[list] = []
    for s in layers:
        sb = f"/{s['sub_batches']}" if s["sub_batches"] > 1 else ""
        label = f"{s['schedule']}{sb}+{s['remat']}"
        if runs and runs[-1][1] == label:
            runs[-1][0] += 1
        else:
            runs.append([1, label])
    return ", ".join(f"{n} x {label}" for n, label in runs)


def hidden_lines(r: dict) -> list[str]:
    """How much of the collectives' simulated time compute covers, by kind, and the step's
    exposed share (reports written before the metric existed have none)."""
    h = r.get("hidden")
    if not h or not r.get("comm_s"):
        return []
    kinds = ", ".join(f"{k} {v['share']:.0%} of {v['comm_s'] * 1e3:.3f} ms"
                      for k, v in h["covered_by_kind"].items())
    lines = [f"covered by compute: {h['hidden_share']:.1%} of the collectives' time ({kinds}); "
             f"exposed: {h['exposed_share']:.1%} of the step"]
    shares = [c["share"] for c in h.get("collectives", ()) if c["end_s"] > c["start_s"]]
    if shares:
        under = sum(s < 0.9 for s in shares)
        lines.append(f"per collective, in program order: covered share "
                     f"{' '.join(f'{s:.2f}' for s in shares[:16])}"
                     f"{' ...' if len(shares) > 16 else ''}; {under} of {len(shares)} under 0.90")
    return lines


def planner_lines(r: dict) -> list[str]:
    """The plan's predicted step beside the simulated one (reports of --plan)."""
    p = r.get("planner_predicted_step_s")
    if not p:
        return []
    return [f"planner predicted: step {_fmt_s(p)}  (simulated / predicted "
            f"{r['simulated_step_s'] / p:.2f}x)"]


def schedule_costs_lines(r: dict) -> list[str]:
    """Whose costs XLA's scheduler ordered the program by, when not its own."""
    costs = r.get("schedule_costs", "xla")
    if costs == "xla":
        return []
    first = r.get("xla_scheduled_step_s")
    was = f" (ordered by XLA's own costs: step {_fmt_s(first).strip()})" if first else ""
    return [f"ordered by {'our simulated costs' if costs == 'simulated' else 'a profile'}{was}; "
            "XLA's estimate below prices that schedule with the same costs, not its own"]


def _xla(r: dict) -> dict | None:
    return r.get("xla_estimate") or None


def xla_lines(r: dict) -> list[str]:
    """XLA's own estimate beside ours (GPU targets): step, exposed comm by kind, comm priced."""
    x = _xla(r)
    if x is None:
        return []
    kinds = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in x["exposed_comm_s"].items()
                      if k != "total" and v)
    line = (f"XLA's estimate:    step {_fmt_s(x['step_s'])}, comm {_fmt_s(x['comm_s']['total'])}, "
            f"exposed comm {_fmt_s(x['exposed_comm_s']['total'])}")
    out = [line + (f" ({kinds} ms)" if kinds else "")]
    attn = x.get("fused_attention")
    if attn:  # XLA prices these at a flat 10 us; the step above uses the roofline instead
        out.append(f"  with {attn['calls']} fused-attention calls at the roofline price "
                   f"{_fmt_s(attn['priced_s']).strip()} (XLA's own: "
                   f"{_fmt_s(attn['xla_s']).strip()})")
    sim, xs = r["simulated_step_s"], x["step_s"]
    if sim and xs:
        out.append(f"XLA / simulated: step {xs / sim:.2f}x, exposed comm "
                   f"{_ratio(x['exposed_comm_s']['total'], r['exposed_comm_s'])}, comm "
                   f"{_ratio(x['comm_s']['total'], r['comm_s'])}")
    return out


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _xla_value(r: dict, key: str) -> float | None:
    x = _xla(r)
    if x is None:
        return None
    return x["step_s"] if key == "step_s" else x[key]["total"]


def compare_table(reports: list[dict]) -> str:
    """Schedules side by side: our simulator's step and exposed communication, and XLA's when
    the reports carry it, each with its ratio to the first schedule under the same opinion."""
    first = next((r for r in reports if "error" not in r), reports[0])
    with_xla = any(_xla(r) for r in reports)
    head = (f"{'schedule':<17} {'sim step':>12} {'ratio':>6} {'exposed':>12} {'ratio':>6} "
            f"{'comm':>12} {'overlap':>7} {'peak MiB':>9} {'ratio':>6}")
    if with_xla:
        head += f" | {'XLA step':>12} {'ratio':>6} {'exposed':>12} {'ratio':>6}"
    lines = [head]
    for r in reports:
        if "error" in r:
            lines.append(f"{r['schedule']:<17} failed: {r['error'][:80]}")
            continue

        def ratio(key, r=r):
            return r[key] / first[key] if first.get(key) else float("nan")

        line = (
            f"{r['schedule']:<17} {_fmt_s(r['simulated_step_s'])} {ratio('simulated_step_s'):6.2f}"
            f" {_fmt_s(r['exposed_comm_s'])} {ratio('exposed_comm_s'):6.2f}"
            f" {_fmt_s(r['comm_s'])} {r['overlap_share']:7.3f}"
            f" {r['peak_memory_bytes'] / MIB:9.1f} {ratio('peak_memory_bytes'):6.2f}"
        )
        if with_xla:
            cells = []
            for key in ("step_s", "exposed_comm_s"):
                v, v0 = _xla_value(r, key), _xla_value(first, key)
                if v is None:
                    cells.append(f"{'-':>12} {'-':>6}")
                else:
                    cells.append(f"{_fmt_s(v)} {v / v0 if v0 else float('nan'):6.2f}")
            line += " | " + " ".join(cells)
        lines.append(line)
    if with_xla:
        lines.append("left: this project's simulator (datasheet roofline and alpha-beta); right: "
                     "XLA's latency estimator (docs/xla_estimate.md); ratios to the first row")
    return "\n".join(lines)


def diff(a: dict, b: dict) -> str:
    """Collectives added or removed (by kind and axes, counting executions) and memory change."""

    def counts(r):
        c = collections.Counter()
        for x in r["collectives"]:
            c[(x["kind"], ",".join(x["axes"]) or "-")] += x["count"]
        return c

    ca, cb = counts(a), counts(b)
    lines = [f"diff {a['schedule']} -> {b['schedule']} on {a['target']}"]
    for key in sorted(set(ca) | set(cb)):
        if ca[key] != cb[key]:
            lines.append(f"  {key[0]:<20} {key[1]:<10} {ca[key]:5d} -> {cb[key]:5d} "
                         f"({cb[key] - ca[key]:+d})")
    if len(lines) == 1:
        lines.append("  same collectives")
    values = [(key, a[key], b[key]) for key in
              ("peak_memory_bytes", "collective_bytes", "simulated_step_s", "exposed_comm_s")]
    if _xla(a) and _xla(b):
        values += [(f"xla_{key}", _xla_value(a, key), _xla_value(b, key))
                   for key in ("step_s", "exposed_comm_s")]
    for key, va, vb in values:
        lines.append(f"  {key:<20} {va:.6g} -> {vb:.6g} ({(vb / va - 1) * 100 if va else 0:+.1f}%)")
    return "\n".join(lines)


TIMELINE_SOURCES = ("sim", "xla")


def xla_events(r: dict) -> list:
    """XLA's timeline from a report's `xla_estimate.per_op`, as drawable events."""
    from oases_jax.streams import Event

    x = _xla(r)
    if x is None:
        raise ValueError(f"report of {r['schedule']} on {r['target']} has no xla_estimate "
                         "(XLA's estimate exists for GPU targets only); use --timeline-source sim")
    return [Event(o["stream"], o["name"], o["kind"], o["start"], o["end"]) for o in x["per_op"]]


def draw_timeline(events, r: dict, path: str, source: str = "sim") -> None:
    """A two-stream timeline as a PNG (compute above, collectives below): our simulator's
    events, or with source="xla" XLA's (`events` None: read from the report)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if source == "xla":
        events = xla_events(r) if events is None else events
        x = _xla(r)
        step, exposed, label = x["step_s"], x["exposed_comm_s"]["total"], "XLA's estimate"
    else:
        step, exposed, label = r["simulated_step_s"], r["exposed_comm_s"], "simulated"
    fig, ax = plt.subplots(figsize=(14, 2.8))
    colors = {"compute": "tab:blue", "comm": "tab:orange"}
    for row, stream in enumerate(("compute", "comm")):
        spans = [(e.start * 1e3, (e.end - e.start) * 1e3)
                 for e in events if e.stream == stream]
        ax.broken_barh(spans, (1 - row + 0.1, 0.8), color=colors[stream], linewidth=0)
    ax.set_yticks([1.5, 0.5], ["compute", "collectives"])
    ax.set_xlabel(f"{label}: time (ms)")
    ax.set_title(
        f"{r['schedule']} on {r['target']} ({label}): step {step * 1e3:.3f} ms, "
        f"exposed comm {exposed * 1e3:.3f} ms"
    )
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)  # as --json creates its own
    fig.savefig(path, dpi=110)
    plt.close(fig)


class _Open(Strict):
    model_config = ConfigDict(extra="allow")  # the fields `diff` does not read ride along


class _Collective(_Open):
    kind: Text
    axes: list[str]
    count: Annotated[int, Field(ge=0)]


class _XlaComm(_Open):
    total: NonNegativeFloat


class _XlaEstimate(_Open):
    step_s: NonNegativeFloat
    exposed_comm_s: _XlaComm


class ReportFile(_Open):
    """What `diff` reads of a report JSON (`inspect_hlo.py --json` of one schedule)."""

    schedule: Text
    target: Text
    collectives: list[_Collective]
    peak_memory_bytes: NonNegativeFloat
    collective_bytes: NonNegativeFloat
    simulated_step_s: NonNegativeFloat
    exposed_comm_s: NonNegativeFloat
    xla_estimate: _XlaEstimate | None = None


def load_report(path: str) -> dict:
    """A report JSON for `diff`, checked (`ReportFile`): one UserError line for a missing file,
    not JSON, or a report without what `diff` reads."""
    fix = "pass a report written by inspect_hlo.py --json (of one schedule)"
    data = read_json(path, "report", fix)
    validate(ReportFile, data, where=f"report {path!r}", kind="report of one schedule", fix=fix)
    return data
