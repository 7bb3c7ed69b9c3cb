"""The stage partitioner on GPT-2 1.5B (fp32, 48 layers and a 50k head) over 4 and 8 stages of
h100-64 (t = 2, M = 2S), with the head on the last stage and split over the stages
(`--split-head on`): stage layers, max / mean stage load and the simulated pipeline step.
`JAX_PLATFORMS=cpu .venv/bin/python benchmarks/split_head_partition.py`
(benchmarks/results/split_head_partition_gpt2-1.5b_h100x64.txt; about 20 s here)."""

import time

from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models import get_preset
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.pipeline import split_head_inputs, stage_inputs, transfer_s
from oases_jax.planner.search.stage_partition import partition


def main() -> None:
    cfg, hw = get_preset("gpt2-1.5b"), Hardware.of(get_cluster("h100-64"))
    spec = LayerSpec(schedule="megatron")
    print("| S | schedule | head | stage layers | max / mean | pipeline step | phase | search |")
    print("|---|---|---|---|---|---|---|---|")
    for S in (4, 8):
        M = 2 * S
        lay = Layout(data=32 // S, tensor=2, microbatches=M, global_batch=256, seq_len=1024)
        x = stage_inputs(cfg, lay, hw, spec)
        heads = {"last stage": x, "split": split_head_inputs(cfg, lay, hw, spec, x, S)}
        p2p = transfer_s(cfg, lay, hw, spec, S)
        for schedule in ("gpipe", "1f1b", "merak"):
            for name, xi in heads.items():
                t0 = time.time()
                sp = partition(xi, schedule=schedule, stages=S, microbatches=M, p2p=p2p,
                               max_sims=24)
                phase = f"{xi.head_phase * 1e3:.2f} ms" if xi.head_phase else \
                    f"({(xi.last_f + xi.last_b) * 1e3:.2f} ms on the last stage)"
                print(f"| {S} | {schedule} | {name} | {','.join(map(str, sp.layers))} | "
                      f"{sp.balance:.3f} | {sp.makespan * 1e3:.1f} ms | {phase} | "
                      f"{time.time() - t0:.2f} s |")


if __name__ == "__main__":
    main()
