"""The cost model agrees with the inspection simulator: whole train steps of GPT-2 1.5B's shape
(32 heads of 50, 4 layers) compiled for h100:8, tensor=8, batch 8 x 1024; the planner's step
(`planner.cost.step_cost.step_cost`) within 15% of the simulator's (docs/planner.md, "Plans")."""

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

# Four layers, not two: a run of one layer compiles without a scan loop, so it has none of the
# stacked-activation traffic the model charges every scanned layer (SCAN_PASSES).
LAYERS = 4
CFG = get_preset("gpt2-1.5b").with_overrides(
    ["n_heads=32", "head_dim=50", f"n_layers={LAYERS}"])
LAYOUT = Layout(tensor=8, global_batch=8, seq_len=1024)
BOUND = 0.15

MEGATRON = LayerSpec(schedule="megatron")
OASES = LayerSpec(schedule="oases", sub_batches=2)
PLANS = [
    pytest.param([MEGATRON] * LAYERS, id="megatron"),
    pytest.param([MEGATRON] * 2 + [LayerSpec(schedule="megatron", remat="full")] * 2,
                 id="megatron+megatron_full_remat"),
    # Measured: model 15.17 ms vs simulator 16.52 (-8%).
    pytest.param([OASES] * LAYERS, id="oases2"),
]


def _simulated_step_s(strategies) -> float:
    from oases_jax.targets import get_target
    from oases_jax.tools.inspection import inspect_program
    from oases_jax.training.config import ParallelConfig
    from oases_jax.training.program import CompileSpec

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


FSDP_CFG = get_preset("llama2-7b").with_overrides(["dtype=bfloat16", "n_layers=8"])


@pytest.mark.parametrize("mesh, layout", [
    pytest.param("data=8", Layout(fsdp=8, global_batch=8, seq_len=2048), id="fsdp8"),
    pytest.param("data=4,tensor=2", Layout(fsdp=4, tensor=2, global_batch=8, seq_len=2048),
                 id="fsdp4-tensor2"),
])
def test_fsdp_step_and_memory_match_the_compiled_program(mesh, layout):
    """FSDP layouts of the Llama-2 7B shape (8 layers, bf16, 8 x 2048, no remat) on h100:8: the
    planner prices each layer's bf16 weight gathers inside the layer loop beside its compute
    (`planner.cost.step_cost.fsdp_comm_s`), and the cast copy of only the local shard in memory;
    step within 15% of the simulator's, peak within 10% of the compiled program's (before:
    every gather fully exposed in fp32, the whole model's bf16 copy in memory: 1.9x the step
    and 1.5x the peak of the 32-layer program)."""
    from oases_jax.targets import get_target
    from oases_jax.tools.inspection import inspect_program
    from oases_jax.training.config import ParallelConfig
    from oases_jax.training.program import CompileSpec

    model = step_cost(FSDP_CFG, layout, [MEGATRON] * FSDP_CFG.n_layers,
                      Hardware.of(get_cluster("h100-8")))
    spec = CompileSpec(model=FSDP_CFG, batch_size=8, seq_len=2048,
                       parallel=ParallelConfig(mesh=mesh, rules="fsdp" if layout.tensor == 1
                                               else "fsdp_tp"))
    ins = inspect_program(spec, get_target("h100:8"))
    sim, peak = ins.sim.step_s, ins.analysis.peak_memory_bytes
    assert abs(model.step_s / sim - 1) <= BOUND, (model.step_s, sim)
    assert abs(model.peak_memory_bytes / peak - 1) <= 0.10, (model.peak_memory_bytes, peak)


def _loop_bodies(program) -> list[str]:
    """The entry's while loops' bodies in program order: the layer loop's forward, then its
    backward."""
    entry = program.comp(program.module.entry)
    return [i.attr("body").lstrip("%") for i in entry.instrs if i.opcode == "while"]


@pytest.mark.parametrize("preset, layout, mesh", [
    pytest.param("gpt2-1.5b", Layout(fsdp=8, global_batch=16, seq_len=1024), "data=8",
                 id="gpt2-fsdp8"),
    pytest.param("llama2-7b", Layout(fsdp=8, global_batch=8, seq_len=2048), "data=8",
                 id="llama-fsdp8"),
    pytest.param("llama2-7b", Layout(fsdp=4, tensor=2, global_batch=8, seq_len=2048),
                 "data=4,tensor=2", id="llama-fsdp4-tensor2"),
])
def test_fsdp_layer_iteration_matches_its_replay(preset, layout, mesh):
    """One iteration of the compiled layer loop, forward and backward, replayed alone by the
    inspection simulator, against the planner's layer (its compute and tensor collectives,
    `LayerModel`, plus what it waits for on FSDP's gathers and reduce-scatters,
    `planner.cost.fsdp_chain`): within 15% each way. The rule before (attention's gathers exposed
    forward, the MLP's backward, the rest hidden behind the loop's compute) priced GPT-2 1.5B's
    backward 0.592 ms against 0.714 replayed (-17%)."""
    from oases_jax.planner.cost.fsdp_chain import layer_exposed
    from oases_jax.planner.cost.layer_cost import LayerModel
    from oases_jax.targets import get_target
    from oases_jax.tools.analysis.simulate import Simulator
    from oases_jax.tools.inspection import inspect_program
    from oases_jax.training.config import ParallelConfig
    from oases_jax.training.program import CompileSpec

    overrides = ["dtype=bfloat16", "n_layers=4"]
    if preset == "gpt2-1.5b":
        overrides += ["n_heads=20", "head_dim=80"]
    cfg = get_preset(preset).with_overrides(overrides)
    spec = LayerSpec(schedule="megatron", remat="none")
    hw = Hardware.of(get_cluster("h100:8"))
    cost = LayerModel(cfg, layout, hw).time(spec)
    fwd_x, bwd_x, _ = layer_exposed(cfg, layout, hw, spec)
    compile_spec = CompileSpec(
        model=cfg, batch_size=layout.global_batch, seq_len=layout.seq_len,
        parallel=ParallelConfig(mesh=mesh, rules="fsdp" if layout.tensor == 1 else "fsdp_tp",
                                layers=(spec,) * cfg.n_layers))
    ins = inspect_program(compile_spec, get_target("h100:8"))
    sim = Simulator(ins.program, ins.target.cluster)
    fwd_body, bwd_body = _loop_bodies(ins.program)[:2]
    for what, model, body in (("forward", cost.fwd_s + fwd_x, fwd_body),
                              ("backward", cost.bwd_s + bwd_x, bwd_body)):
        replayed = sim.replay(body).step_s
        assert abs(model / replayed - 1) <= BOUND, (
            f"{what}: model {model * 1e3:.3f} ms vs replayed {replayed * 1e3:.3f} ms")


def test_replica_reduction_sits_in_the_backward_loop_in_the_compute_dtype():
    """What `step_cost.replica_reduce_s` assumes of a data-parallel step without micro-batches:
    the backward loop all-reduces each layer's weight-matrix gradients over `data`, in bf16,
    one collective a layer of e x the layer's matrices / tensor bytes (GPT-2 1.5B's shape,
    data=2,tensor=4, h100:8); the rest of the reduction sits outside the loops."""
    from oases_jax.planner.cost.layer_work import layer_matrices
    from oases_jax.targets import get_target
    from oases_jax.tools.inspection import inspect_program
    from oases_jax.training.config import ParallelConfig
    from oases_jax.training.program import CompileSpec

    cfg = get_preset("gpt2-1.5b").with_overrides(
        ["dtype=bfloat16", "n_layers=4", "n_heads=20", "head_dim=80"])
    spec = CompileSpec(model=cfg, batch_size=16, seq_len=1024,
                       parallel=ParallelConfig(mesh="data=2,tensor=4", rules="tp"))
    ins = inspect_program(spec, get_target("h100:8"))
    bwd_body = _loop_bodies(ins.program)[-1]
    in_loop = [c for c in ins.program.collectives()
               if c.computation == bwd_body and c.axes == ("data",) and c.bytes > 2**20]
    assert len(in_loop) == 1 and in_loop[0].kind == "all-reduce"
    # the matrices and the tensor-sharded biases beside them (6400 B)
    assert in_loop[0].bytes == pytest.approx(2 * sum(layer_matrices(cfg)) / 4, rel=1e-3)


def test_primepar_peak_counts_the_score_stacks_xla_relays_out():
    """oases-h2048-l24 (fp32, materialised scores, no remat) under primepar on the bridged 3090
    cluster, as the benchmark set plans it: XLA transposes each whole stack of saved f32 scores
    into a fresh buffer between the layer loops (`planner.cost.step_cost.score_relayout_bytes`), and
    the planner's peak is within 10% of the compiled program's (10.2% low without the copy)."""
    import math
    import re

    from oases_jax.planner.cost.layer_cost import LayerModel
    from oases_jax.planner.plan import candidate_plan, from_json
    from oases_jax.planner.search.dense import Candidate
    from oases_jax.planner.verification.verify import target_for
    from oases_jax.tools.inspection import inspect_program

    cfg = get_preset("oases-h2048-l24")
    layout = Layout(data=8, tensor=4, primepar=True, global_batch=32, seq_len=1024)
    spec = LayerSpec(schedule="primepar")
    cluster = get_cluster("3090-nvlink-32")
    hw = Hardware.of(cluster)
    cost = step_cost(cfg, layout, [spec] * cfg.n_layers, hw)
    plan = candidate_plan(Candidate(layout, (spec,) * cfg.n_layers, cost))
    ins = inspect_program(from_json(plan, "test").compile_spec(cfg), target_for(cluster))
    # The stack: one f32 score tensor of each of the 24 layers.
    stack = cfg.n_layers * LayerModel(cfg, layout, hw).time(spec).score_copy_bytes / 4
    shapes = re.findall(r"= f32\[([\d,]+)\]\{[\d,]+\} fusion\([^)]*\), kind=kInput, "
                        r"calls=%fused_transpose", ins.program.text)
    assert any(math.prod(map(int, s.split(","))) == stack for s in shapes), shapes[:10]
    peak = ins.analysis.peak_memory_bytes
    assert abs(cost.peak_memory_bytes / peak - 1) <= 0.10, (cost.peak_memory_bytes, peak)
