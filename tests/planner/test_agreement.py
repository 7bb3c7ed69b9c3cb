"""The cost model agrees with the inspection simulator: whole train steps of GPT-2 1.5B's shape
(32 heads of 50, 4 layers) compiled for h100:8, tensor=8, batch 8 x 1024; the planner's step
(`planner.costs.step_cost`) within 15% of the simulator's (docs/planner.md, "Plans")."""

import pytest

from models.presets import get_preset
from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.targets import has_gpu_aot
from planner.costs import Hardware, Layout, Strategy, step_cost

pytestmark = [pytest.mark.gpu_aot,
              pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")]

# Four layers, not two: a run of one layer compiles without a scan loop, so it has none of the
# stacked-activation traffic the model charges every scanned layer (SCAN_PASSES).
LAYERS = 4
CFG = get_preset("gpt2-1.5b").with_overrides(
    ["n_heads=32", "head_dim=50", f"n_layers={LAYERS}"])
LAYOUT = Layout(tensor=8, global_batch=8, seq_len=1024)
BOUND = 0.15

MEGATRON = Strategy(schedule="megatron")
OASES = Strategy(schedule="oases", sub_batches=2)
PLANS = [
    pytest.param([MEGATRON] * LAYERS, id="megatron"),
    pytest.param([MEGATRON] * 2 + [Strategy(schedule="megatron", remat="full")] * 2,
                 id="megatron+megatron_full_remat"),
    # Measured: 2 layers 7.81 vs 10.44 ms, 4 layers 14.24 vs 17.77; unscanned 10.30 vs 12.86.
    pytest.param([OASES] * LAYERS, id="oases2", marks=pytest.mark.xfail(strict=True, reason=(
        "model 14.2 ms vs simulator 17.8 ms (-20%). Outside the layers the simulator spends "
        "3.1 ms, the model 1.45 (head_cost + AdamW): GPU_OPTIONS['oases'] turns XLA's "
        "all-reduce combiner off for the whole program, so the gradient norm's 22 scalar "
        "all-reduces stay apart (about 0.9 ms, mostly synchronous), and, as for megatron "
        "(2.3 vs 1.45 ms), head_cost has no embedding all-reduce (50 MiB, exposed), no "
        "cross-entropy all-reduces and 4 of the compiled loss's ~9 passes over the f32 "
        "logits. Per layer 3.66 vs 3.18 ms: the unscanned oases layer 2.44 vs 2.20, the "
        "scan's stacking 1.23 vs SCAN_PASSES' 0.99"))),
]


def _simulated_step_s(strategies) -> float:
    from oases_jax.targets import get_target
    from training.compiled import CompileSpec, inspect_program
    from training.config import ParallelConfig

    layers = tuple(LayerSpec(schedule=s.schedule, sub_batches=s.sub_batches, remat=s.remat)
                   for s in strategies)
    spec = CompileSpec(model=CFG, batch_size=LAYOUT.global_batch, seq_len=LAYOUT.seq_len,
                       parallel=ParallelConfig(mesh="tensor=8", rules="tp", layers=layers))
    return inspect_program(spec, get_target("h100:8")).sim.step_s


@pytest.mark.parametrize("strategies", PLANS)
def test_model_step_within_15_percent_of_the_simulator(strategies):
    model = step_cost(CFG, LAYOUT, strategies, Hardware.of(get_cluster("h100-8"))).step_s
    sim = _simulated_step_s(strategies)
    plan = ", ".join(s.label() for s in strategies)
    assert abs(model / sim - 1) <= BOUND, (
        f"{plan}: model {model * 1e3:.2f} ms vs simulator {sim * 1e3:.2f} ms "
        f"({model / sim - 1:+.1%}), outside +-{BOUND:.0%}")
