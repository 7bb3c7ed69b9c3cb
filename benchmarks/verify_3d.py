"""Compile the 3D search's top 6 plans for GPT-2 1.5B (bf16, attention=xla) on h100:16 and set the
prediction beside the compiled step (planner/verification/verify_pipeline.py).
`JAX_PLATFORMS=cpu .venv/bin/python benchmarks/verify_3d.py OUT.json [--spmd-everywhere]
[--heads N]` (benchmarks/results/verify_3d_gpt2-1.5b_h100x16.{txt,json}; 2-13 minutes here).
`--spmd-everywhere`: the search offers the SPMD pipelines on every layout, not only where a ring
strategy wins (`search_3d(spmd_everywhere=True)`;
benchmarks/results/verify_3d_spmd_everywhere_gpt2-1.5b_h100x16.txt). `--heads 20`: 20 heads of 80 in
place of 25 of 64, so tensor degrees 2 and 4 divide them and the search's top plans put tensor
parallelism inside the stages (benchmarks/results/verify_3d_gpt2-1.5b-h20_h100x16.txt)."""

import argparse
import json
import pathlib
import time

from oases_jax.hardware import get_cluster
from oases_jax.models import get_preset
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.search.pipeline import timed_search
from oases_jax.planner.verification.verify_pipeline import agreement, table, verify_3d


def main(out: str, spmd_everywhere: bool = False, heads: int | None = None) -> None:
    cfg = get_preset("gpt2-1.5b").replace(dtype="bfloat16", attention="xla")
    if heads:
        cfg = cfg.replace(n_heads=heads)
    hw = Hardware.of(get_cluster("h100:16"))
    cands, secs = timed_search(cfg, hw, global_batch=32, seq_len=1024,
                               spmd_everywhere=spmd_everywhere)
    print(f"search {secs:.2f} s, {len(cands)} candidates", flush=True)
    for c in cands[:6]:
        print(" ", c.summary(), f"{c.step_s * 1e3:.1f} ms", flush=True)
    t0 = time.time()
    rows = verify_3d(cfg, cands, "h100:16", model="gpt2-1.5b", cluster="h100:16", n=6)
    print(table(rows))
    print(agreement(rows))
    print(f"verify {time.time() - t0:.0f} s")
    pathlib.Path(out).write_text(json.dumps({"rows": [r.to_json() for r in rows],
                                             "agreement": agreement(rows)}, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the JSON file to write")
    ap.add_argument("--spmd-everywhere", action="store_true")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default 25)")
    args = ap.parse_args()
    main(args.out, args.spmd_everywhere, args.heads)
