"""The MoE layer sweep: Parm's schedules priced by the alpha-beta model
(`oases_jax.moe.cost`) over a grid of layer configurations on a cluster, with each
configuration's auto choice and its speedup over the ds_moe baseline (`scripts/moe_sweep.py`)."""

from __future__ import annotations

import itertools
import statistics

from oases_jax.hardware import ClusterSpec, get_cluster
from oases_jax.moe import cost as cost

# WORKLOADS.md: E in {8, 16, 32}, hidden in {768, 1024, 2048} (GPT-2 experts: FFN 4x, with
# biases), tokens per device in {1k, 4k, 16k}, top-1 / top-2, capacity factor 1.0 / 2.0: 108
# layers per cluster.
GRID = {"experts": (8, 16, 32), "hidden": (768, 1024, 2048), "tokens": (1024, 4096, 16384),
        "top_k": (1, 2), "capacity_factor": (1.0, 2.0)}
# (cluster, ep, mp): one node of 8 H100s as expert=2,tensor=4; 8 nodes of 4 V100s with MP=ESP
# inside a node and EP across nodes (Parm's setting).
CLUSTERS = (("h100-8", 2, 4), ("v100-32", 8, 4))


def hardware(cluster: ClusterSpec, ep: int, mp: int) -> cost.MoEHardware:
    """The links of an expert=ep,tensor=mp mesh laid out tensor-fastest over the cluster's
    device ids (MP groups are consecutive devices, EP groups stride by mp)."""
    return cost.MoEHardware.of(cluster, [i * mp for i in range(ep)], list(range(mp)))


def sweep(clusters=CLUSTERS, grid=GRID, dtype_bytes: int = 2) -> list[dict]:
    """One row per (cluster, configuration): each schedule's forward + backward seconds, the
    auto choice and its speedup over ds_moe."""
    rows = []
    for name, ep, mp in clusters:
        cluster = get_cluster(name)
        hw = hardware(cluster, ep, mp)
        for e, d, t, k, f in itertools.product(*grid.values()):
            shape = cost.LayerShape(tokens=t, d_model=d, d_ff=4 * d, experts=e, top_k=k,
                                    capacity_factor=f, dtype_bytes=dtype_bytes, ep=ep, mp=mp,
                                    bias=True)
            rows.append({"cluster": name, "ep": ep, "mp": mp, "experts": e, "hidden": d,
                         "tokens": t, "top_k": k, "capacity_factor": f,
                         **cost.speedup(shape, hw)})
    return rows


def summary(rows: list[dict]) -> dict:
    """Per cluster: min / median / max speedup of auto over ds_moe and of S1 alone, and how
    often auto picked S2."""
    out = {}
    for name in dict.fromkeys(r["cluster"] for r in rows):
        sel = [r for r in rows if r["cluster"] == name]
        auto = [r["speedup"] for r in sel]
        s1 = [r["ds_moe_s"] / r["parm_s1_s"] for r in sel]
        out[name] = {"layers": len(sel), "auto_speedup": _mmm(auto), "s1_speedup": _mmm(s1),
                     "s2_chosen": sum(r["auto"].startswith("parm_s2") for r in sel)}
    return out


def _mmm(xs) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def markdown(rows: list[dict]) -> str:
    lines = ["| cluster | layers | auto / ds_moe min / median / max | "
             "S1 / ds_moe min / median / max | S2 chosen |", "|---|---|---|---|---|"]
    for name, s in summary(rows).items():
        a, b = s["auto_speedup"], s["s1_speedup"]
        lines.append(f"| {name} | {s['layers']} | {a['min']:.2f} / {a['median']:.2f} / "
                     f"{a['max']:.2f} | {b['min']:.2f} / {b['median']:.2f} / {b['max']:.2f} | "
                     f"{s['s2_chosen']} |")
    return "\n".join(lines)


__all__ = ["CLUSTERS", "GRID", "markdown", "summary", "sweep"]
