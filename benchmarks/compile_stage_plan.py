"""Price one 3D plan of GPT-2 1.5B (bf16, attention=xla, global batch 32 x 1024) and compile it
deviceless for h100:16 through the one compile path (the program `train.py --plan` runs), then
print the prediction beside the tick-by-tick step and each branch's cost
(planner/verification/verify_pipeline.py, `analysis.pipeline_time`). For A/B runs of the tick
executor across commits: run it at each and compare.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/compile_stage_plan.py \
        STAGES DATA TENSOR MICROBATCHES SCHEDULE [--heads N] [--layers L]

e.g. `2 4 2 8 gpipe --heads 20` (about 30 s here): 182.7 ms compiled against 184.2 predicted
(250.9 before the executor loaded residual slots with a gather)."""

import argparse
import time

from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models import get_preset
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout
from oases_jax.planner.verification.verify_pipeline import candidate, compile_candidate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("stages", type=int)
    ap.add_argument("data", type=int)
    ap.add_argument("tensor", type=int)
    ap.add_argument("microbatches", type=int)
    ap.add_argument("schedule", choices=("gpipe", "1f1b", "interleaved", "merak"))
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default 25)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default 48)")
    args = ap.parse_args()
    cfg = get_preset("gpt2-1.5b").replace(dtype="bfloat16", attention="xla")
    if args.heads:
        cfg = cfg.replace(n_heads=args.heads)
    if args.layers:
        cfg = cfg.replace(n_layers=args.layers)
    hw = Hardware.of(get_cluster("h100:16"))
    lay = Layout(data=args.data, tensor=args.tensor, microbatches=args.microbatches,
                 global_batch=32, seq_len=1024)
    cand = candidate(cfg, hw, args.stages, lay, LayerSpec(schedule="megatron"), args.schedule)
    if cand is None:
        raise SystemExit("no stage partition of this plan fits an H100's memory budget")
    print(f"{cand.summary()}: predicted {cand.step_s * 1e3:.1f} ms", flush=True)
    t0 = time.time()
    pipe = compile_candidate(cfg, cand, "h100:16", model="gpt2-1.5b",
                             cluster="h100:16").pipeline
    print("branches (ms): " + ", ".join(f"{b['kind']}{b['virtual_stage']} "
                                        f"{b['step_s'] * 1e3:.2f}" for b in pipe["branches"]))
    print(f"compiled: step {pipe['step_s'] * 1e3:.1f} ms = outside the loop "
          f"{pipe['outside_s'] * 1e3:.1f} + {pipe['ticks']} ticks {pipe['loop_s'] * 1e3:.1f} "
          f"(rest of a tick {pipe['rest_s'] * 1e3:.3f} ms); compiled in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
