"""A pipelined program's step as a picture: one row per stage, each tick of the tick loop as
long as `pipeline_time` prices it (the slowest stage's branch, then the permutes and buffer
updates every stage runs), each stage's action coloured by kind and its wait for the slowest
stage hatched as idle (docs/inspection.md, "Timing a pipelined program"). matplotlib is imported
only when drawing."""

from __future__ import annotations

import pathlib

import numpy as np

from oases_jax.pipeline.executor import BRANCH, MB
from oases_jax.tools.analysis.pipeline_stages import base_kind
from oases_jax.tools.analysis.pipeline_time import PipelineTime

COLORS = {"F": "tab:blue", "FS": "tab:cyan", "R": "tab:orange", "B": "tab:green"}
NAMES = {"F": "forward (F)", "FS": "forward, input stashed (F/PF)",
         "R": "recompute (R/RrG)", "B": "backward (B)"}


def timeline_json(pt: PipelineTime) -> dict:
    """What `draw` needs beyond `PipelineTime.to_json()`: per tick its start in the loop and
    length, and per tick, lane and stage the branch and micro-batch (-1 where idle)."""
    ticks = pt.ticks_s
    rows = pt.plan.lane_rows()[..., [BRANCH, MB]].copy()
    rows[..., 1] = np.where(rows[..., 0] > 0, rows[..., 1], -1)
    return {"tick_start_s": (ticks.cumsum() - ticks).tolist(), "tick_s": ticks.tolist(),
            "rows": rows.tolist()}


def _label(kind: str, j: int, mb: int, stages: int, chunks: int) -> str:
    part = "abcdefgh"[int(kind[1:])] if kind[0] == "B" and kind[1:].isdigit() else ""
    chunk = f".{j // stages}" if chunks > 1 else ""
    return f"{base_kind(kind)[0]}{mb}{chunk}{part}"


def draw(pipeline: dict, path: str, title: str = "") -> None:
    """Write the PNG of a report's `pipeline` block (`PipelineTime.to_json()` with
    `timeline_json`'s keys) to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.patches as mpatches
    import matplotlib.pyplot as plt

    p, ms = pipeline, 1e3
    S, T = p["stages"], p["ticks"]
    branches = p["branches"]
    chunks = max(1, (max(b["virtual_stage"] for b in branches) + 1) // S)
    fig, ax = plt.subplots(figsize=(max(8.0, min(24.0, 0.45 * T + 3)), 0.7 * S + 2.0))
    rest = p["rest_s"] * ms
    for t in range(T):
        start, length = p["tick_start_s"][t] * ms, p["tick_s"][t] * ms - rest
        for s in range(S):
            y = S - 1 - s
            busy = 0.0
            for lane in p["rows"][t]:  # a fused tick's lanes run one after another
                b, mb = lane[s]
                if not b:
                    continue
                kind = base_kind(branches[b]["kind"])
                width = branches[b]["step_s"] * ms
                ax.broken_barh([(start + busy, width)], (y + 0.1, 0.8),
                               color=COLORS.get(kind, "gray"), edgecolor="white", linewidth=0.4)
                if T <= 60:
                    ax.text(start + busy + width / 2, y + 0.5,
                            _label(branches[b]["kind"], branches[b]["virtual_stage"], mb, S,
                                   chunks), ha="center", va="center", fontsize=6, color="white")
                busy += width
            if length > busy:
                ax.broken_barh([(start + busy, length - busy)], (y + 0.1, 0.8),
                               facecolor="whitesmoke", edgecolor="lightgray", hatch="////",
                               linewidth=0.2)
            if rest > 0:
                ax.broken_barh([(start + length, rest)], (y + 0.1, 0.8), color="darkgray",
                               linewidth=0)
    ax.set_yticks([S - 1 - s + 0.5 for s in range(S)], [f"stage {s}" for s in range(S)])
    ax.set_xlim(0, (p["tick_start_s"][-1] + p["tick_s"][-1]) * ms if T else 1)
    ax.set_ylim(0, S)
    ax.set_xlabel("time in the tick loop (ms)")
    idle = ", ".join(f"{x:.0%}" for x in p["idle_fraction"])
    ax.set_title((title + "\n" if title else "")
                 + f"{p['schedule']}: S={S}, M={p['microbatches']}, {T} "
                 f"{'fused ' if p.get('lanes', 1) > 1 else ''}ticks, loop "
                 f"{p['loop_s'] * ms:.2f} ms (+{p['outside_s'] * ms:.2f} ms outside); idle per "
                 f"stage {idle}", fontsize=9)
    kinds = [k for k in COLORS if any(base_kind(b["kind"]) == k for b in branches)]
    handles = [mpatches.Patch(color=COLORS[k], label=NAMES[k]) for k in kinds]
    handles.append(mpatches.Patch(facecolor="whitesmoke", edgecolor="lightgray", hatch="////",
                                  label="idle: waits for the tick's slowest stage"))
    handles.append(mpatches.Patch(color="darkgray", label="permutes and buffer updates"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=3,
              fontsize=7, frameon=False)
    fig.tight_layout()
    pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)  # as --json creates its own
    fig.savefig(path, dpi=110)
    plt.close(fig)
