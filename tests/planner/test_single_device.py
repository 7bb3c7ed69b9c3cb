"""The planner's single-device step and memory against the compiled program: bf16 train steps of
GPT-2 1.5B (48 layers) and of the Llama-2 7B shape (8 layers), batch 8 x 1024, with full remat
and without, compiled for one H100 without a GPU (cuDNN's fused attention, the weights cast
once per step, the hand-written loss, norm and bias backwards). The planner prices the passes
outside the GEMMs as that program makes them (`planner.cost.layer_work.ACTIVATION_PASSES`,
`WEIGHT_SLICE_PASSES`, `planner.cost.step_cost.update_s`, `LOGIT_PASSES`): its step within 8% of
the simulator's and its peak memory within 10% of `memory_analysis()` (docs/planner.md, "One
device: the passes outside the GEMMs")."""

import pytest

from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.presets import get_preset
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import step_cost
from oases_jax.planner.layout import Layout
from oases_jax.targets import has_gpu_aot

pytestmark = [pytest.mark.slow, pytest.mark.gpu_aot,
              pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")]

LAYOUT = Layout(global_batch=8, seq_len=1024)
STEP_BOUND, MEMORY_BOUND = 0.08, 0.10
MODELS = {"gpt2-1.5b": [], "llama2-7b-l8": ["n_layers=8"]}


def _config(name: str, remat: str):
    preset = name.removesuffix("-l8")
    return get_preset(preset).with_overrides(MODELS[name] + ["dtype=bfloat16", f"remat={remat}"])


def _compiled(cfg):
    from oases_jax.targets import get_target
    from oases_jax.tools.inspection import inspect_program
    from oases_jax.training.config import ParallelConfig
    from oases_jax.training.program import CompileSpec

    spec = CompileSpec(model=cfg, batch_size=LAYOUT.global_batch, seq_len=LAYOUT.seq_len,
                       parallel=ParallelConfig(mesh="data=1", rules="tp"))
    ins = inspect_program(spec, get_target("h100:1"))
    assert ins.report()["attention_kernel"] == "cudnn_flash"
    return ins.sim.step_s, ins.analysis.peak_memory_bytes


@pytest.mark.parametrize("remat", ["full", "none"])
@pytest.mark.parametrize("name", list(MODELS))
def test_single_device_step_and_memory_match_the_compiled_program(name, remat):
    cfg = _config(name, remat)
    model = step_cost(cfg, LAYOUT, [LayerSpec(remat=remat)] * cfg.n_layers,
                      Hardware.of(get_cluster("h100:1")))
    sim_s, peak = _compiled(cfg)
    assert abs(model.step_s / sim_s - 1) <= STEP_BOUND, (
        f"{name} remat={remat}: model {model.step_s * 1e3:.1f} ms vs simulator "
        f"{sim_s * 1e3:.1f} ms ({model.step_s / sim_s - 1:+.1%}), outside +-{STEP_BOUND:.0%}")
    assert abs(model.peak_memory_bytes / peak - 1) <= MEMORY_BOUND, (
        f"{name} remat={remat}: model {model.peak_memory_bytes / 2**30:.2f} GiB vs compiled "
        f"{peak / 2**30:.2f} GiB ({model.peak_memory_bytes / peak - 1:+.1%}), outside "
        f"+-{MEMORY_BOUND:.0%}")
