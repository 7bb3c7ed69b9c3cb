"""Re-price the benchmark set's verified plans with the planner as it is now, beside the simulated
steps their compiled programs were read at (no compile: the programs do not depend on the
planner), to see what a cost-model change does before re-running the set.

    .venv/bin/python benchmarks/reprice_benchmark_set.py [DIR]

DIR defaults to benchmarks/results/benchmark_set.
"""

import glob
import json
import os
import re
import sys

from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import step_cost
from oases_jax.planner.layout import Layout

BOUND = 0.15


def strategies(label: str) -> list[LayerSpec]:
    """`4 x oases/2+none, 1 x megatron+full` after the layout's colon, as layer specs."""
    out = []
    for part in label.split(": ", 1)[1].split(", "):
        count, text = part.split(" x ", 1)
        m = re.fullmatch(r"(\w+?)(?:/(\d+))?\+(\w+)", text.strip())
        out += [LayerSpec(schedule=m.group(1), sub_batches=int(m.group(2) or 1),
                          remat=m.group(3))] * int(count)
    return out


def layout(c: dict, plan: dict) -> Layout:
    mesh, fsdp = c["mesh"], c["rules"].startswith("fsdp")
    square = "tp_row" in mesh
    t = mesh["tp_row"] * mesh["tp_col"] if square else mesh.get("tensor", 1)
    d = mesh.get("data", 1)
    return Layout(data=1 if fsdp else d, fsdp=d if fsdp else 1, tensor=t,
                  microbatches=c["microbatches"], global_batch=plan["global_batch"],
                  seq_len=plan["seq_len"], primepar=square)


def main() -> int:
    where = sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results/benchmark_set"
    files = sorted(glob.glob(os.path.join(where, "plan_*.json")))
    if not files:
        print(f"reprice_benchmark_set.py: no plan_*.json in {where!r}; run "
              "benchmarks/benchmark_set.sh first", file=sys.stderr)
        return 2
    ratios = []
    for path in files:
        plan = json.load(open(path))
        cfg = ModelConfig(**plan["model_config"])
        hw = Hardware.of(get_cluster(plan["cluster"]))
        print(f"== {os.path.basename(path)}")
        for c in plan["verified"]["candidates"]:
            if c.get("simulated_step_s") is None:
                continue
            cost = step_cost(cfg, layout(c, plan), strategies(c["label"]), hw)
            then, now = (x / c["simulated_step_s"] for x in (c["predicted_step_s"], cost.step_s))
            ratios.append(now)
            print(f"  {c['label'][:72]:72} then {then:5.2f} now {now:5.2f} "
                  f"({cost.step_s * 1e3:.1f} / {c['simulated_step_s'] * 1e3:.1f} ms)")
    within = sum(abs(r - 1) <= BOUND for r in ratios)
    print(f"predicted / simulated within {BOUND:.0%}: {within} of {len(ratios)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
