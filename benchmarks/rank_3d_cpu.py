"""Ten 3D plans of the `small` model for the 8 CPU devices, written as plan files and measured
side by side with `scripts/bench.py --plan` (docs/planner.md, "Ranking on the CPU devices").

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/rank_3d_cpu.py DIR
    JAX_PLATFORMS=cpu python scripts/bench.py --model small --batch-size 16 --seq-len 128 \\
        $(ls DIR/*.json | sed 's/^/--plan /') --predict profile --json OUT.json

The search runs on `cpu-8` with its calibration profile (`planner/profiles/cpu-8.json`); the
ten plans are the search's best candidate for each distinct (mesh, micro-batches, schedule),
best first, with Megatron-LM's plan among them when the search ranked it.
"""

from __future__ import annotations

import pathlib
import sys

from oases_jax.hardware import get_cluster
from oases_jax.models import get_preset
from oases_jax.planner import load_profile
from oases_jax.planner import plan as plans
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.search.pipeline import search_3d

BATCH, SEQ, N = 16, 128, 10


def main(out_dir: str) -> None:
    cfg = get_preset("small")
    cluster = get_cluster("cpu-8")
    hw = Hardware.of(cluster, load_profile("profile", cluster))
    cands = search_3d(cfg, hw, global_batch=BATCH, seq_len=SEQ, refine=24)
    seen, chosen = set(), []
    for c in cands:
        key = (tuple(c.mesh().items()), c.layout.microbatches, c.stage_plan.schedule)
        if key not in seen:
            seen.add(key)
            chosen.append(c)
        if len(chosen) == N:
            break
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for i, c in enumerate(chosen):
        d = plans.pipeline_plan_json(c, model="small", cfg=cfg, cluster="cpu-8",
                                     cost_source="profile", search_s=0.0)
        mesh = "".join(f"{k[0]}{v}" for k, v in c.mesh().items())
        name = f"p{i:02d}-{mesh}-{c.stage_plan.schedule}-m{c.layout.microbatches}"
        plans.save(d, out / f"{name}.json")
        print(f"{name}: {c.summary()} predicted {c.step_s * 1e3:.1f} ms")


if __name__ == "__main__":
    main(sys.argv[1])
