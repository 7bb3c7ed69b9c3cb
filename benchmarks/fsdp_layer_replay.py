"""One iteration of the layer loop of FSDP plans, compiled deviceless for h100:8 and replayed
alone by the inspection simulator (forward loop, then backward loop), beside the planner's price
of the same layer: `LayerModel` (compute and tensor collectives) plus what it waits for on FSDP's
gathers and reduce-scatters (`planner.cost.fsdp_chain`).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/fsdp_layer_replay.py

(benchmarks/results/fsdp_layer_replay_h100x8.txt; about a minute here). 4-layer programs: the
loop body is the same at any depth."""

import time

import jax

from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models import get_preset
from oases_jax.planner.cost.fsdp_chain import layer_exposed
from oases_jax.planner.cost.layer_cost import LayerModel
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import step_cost
from oases_jax.planner.layout import Layout
from oases_jax.planner.search.dense import Candidate
from oases_jax.planner.verification.verify import candidate_spec
from oases_jax.targets import get_target
from oases_jax.tools.analysis.simulate import Simulator
from oases_jax.tools.inspection import inspect_program

GPT2 = ["dtype=bfloat16", "n_layers=4", "n_heads=20", "head_dim=80"]
LLAMA = ["dtype=bfloat16", "n_layers=4"]
CASES = [("gpt2-1.5b", GPT2, Layout(fsdp=8, global_batch=16, seq_len=1024)),
         ("gpt2-1.5b", GPT2, Layout(fsdp=4, tensor=2, global_batch=16, seq_len=1024)),
         ("llama2-7b", LLAMA, Layout(fsdp=8, global_batch=8, seq_len=2048)),
         ("llama2-7b", LLAMA, Layout(fsdp=4, tensor=2, global_batch=8, seq_len=2048))]
SPEC = LayerSpec(schedule="megatron", remat="none")


def main() -> None:
    hw = Hardware.of(get_cluster("h100:8"))
    print(f"{'model':10} {'layout':22} {'dir':4} {'replayed':>9} {'compute':>8} {'comm':>7} "
          f"{'model':>7} {'ratio':>6}   (ms a layer and micro-batch)")
    for preset, overrides, layout in CASES:
        cfg = get_preset(preset).with_overrides(overrides)
        cost = LayerModel(cfg, layout, hw).time(SPEC)
        fwd_x, bwd_x, _ = layer_exposed(cfg, layout, hw, SPEC)
        t0 = time.perf_counter()
        plan = (SPEC,) * cfg.n_layers  # compiled from its plan, as plan.py --verify does
        spec = candidate_spec(Candidate(layout, plan, step_cost(cfg, layout, plan, hw)), cfg)
        ins = inspect_program(spec, get_target("h100:8"))
        sim = Simulator(ins.program, ins.target.cluster)
        entry = ins.program.comp(ins.program.module.entry)
        bodies = [i.attr("body").lstrip("%") for i in entry.instrs if i.opcode == "while"]
        for what, model, body in (("fwd", cost.fwd_s + fwd_x, bodies[0]),
                                  ("bwd", cost.bwd_s + bwd_x, bodies[1])):
            r = sim.replay(body)
            print(f"{preset:10} {layout.label():22} {what:4} {r.step_s * 1e3:9.3f} "
                  f"{r.compute_s * 1e3:8.3f} {r.comm_s * 1e3:7.3f} {model * 1e3:7.3f} "
                  f"{model / r.step_s:6.2f}", flush=True)
        print(f"  (compiled in {time.perf_counter() - t0:.0f} s)")
        jax.clear_caches()


if __name__ == "__main__":
    main()
