"""Compile pipelined plans with FSDP and tensor parallelism inside the stages (`--rules fsdp_tp`)
for GPT-2 1.5B with 20 heads (bf16, attention=xla) on h100:16, and set the 3D search's price
(`planner.cost.stage_fsdp.fsdp_layer_s`) beside our simulator's step of each compiled program
(planner/verification/verify_pipeline.py). The last plan runs `oases` inside the stages, which
the search does not offer under fsdp_tp (`FSDP_TP_STAGE_SCHEDULES`).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/verify_fsdp_tp_stages.py

(benchmarks/results/verify_fsdp_tp_stages_gpt2-1.5b-h20_h100x16.txt; about 3 minutes here)."""

import time

from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models import get_preset
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout
from oases_jax.planner.verification.verify_pipeline import agreement, candidate, table, verify_3d

# (stages, fsdp, tensor, micro-batches, schedule, layer schedule)
PLANS = [(2, 4, 2, 2, "interleaved", "megatron"), (2, 4, 2, 4, "interleaved", "megatron"),
         (2, 4, 2, 4, "gpipe", "megatron"), (2, 4, 2, 4, "1f1b", "megatron"),
         (2, 2, 4, 4, "gpipe", "megatron"), (2, 4, 2, 4, "gpipe", "oases")]


def main() -> None:
    cfg = get_preset("gpt2-1.5b").replace(dtype="bfloat16", attention="xla", n_heads=20)
    hw = Hardware.of(get_cluster("h100:16"))
    cands = []
    for S, f, t, M, sch, layer in PLANS:
        lay = Layout(fsdp=f, tensor=t, microbatches=M, global_batch=32, seq_len=1024)
        strategy = LayerSpec(schedule=layer, sub_batches=2 if layer == "oases" else 1)
        cands.append(candidate(cfg, hw, S, lay, strategy, sch))
        print(f"  {cands[-1].summary()} {cands[-1].step_s * 1e3:.1f} ms", flush=True)
    t0 = time.time()
    rows = verify_3d(cfg, cands, "h100:16", model="gpt2-1.5b", cluster="h100:16",
                     n=len(cands))
    print(table(rows))
    print("megatron plans:", agreement(rows[:-1]))
    print(f"verify {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
