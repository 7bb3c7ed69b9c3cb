"""The compiled pipelined step (CPU, through training/program.py): stage-to-stage transfers only
between neighbours (no wrap-around edge in a non-circular schedule), no reduction over `data`
inside the tick loop and one after it, no [S, ...param...] gradient tensor, and 1F1B's temporary
memory flat in M where GPipe's grows."""

from __future__ import annotations

import jax
import pytest

from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.tools.analysis import hlo
from oases_jax.training import ParallelConfig
from oases_jax.training.program import CompileSpec, lower

MESH = "data=2,stage=4"  # device d: data d // 4, stage d % 4
CFG = get_preset("tiny").replace(n_layers=4, d_model=128, d_ff=512)


def _compile(schedule: str, m: int):
    spec = CompileSpec(model=CFG, parallel=ParallelConfig(mesh=MESH, rules="tp",
                                                          schedule="megatron",
                                                          pipeline=PipelineConfig(schedule=schedule)),
                       batch_size=4 * m, seq_len=64, microbatches=m)
    return lower(spec, make_mesh(MESH, jax.devices())).compile()


@pytest.fixture(scope="module")
def one_f_one_b():
    return _compile("1f1b", 8)


def _walk(module, comp, seen=None):
    """Every instruction of `comp` and of what it calls."""
    seen = set() if seen is None else seen
    for ins in comp.instrs:
        yield ins
        for c in ins.called:
            if c in module.computations and c not in seen:
                seen.add(c)
                yield from _walk(module, module.computations[c], seen)


def _tick_loop(module):
    """The one while loop whose body holds the tick's switch, and that body."""
    loops = [i for i in _walk(module, module.computations[module.entry]) if i.opcode == "while"
             and any(j.opcode == "conditional"
                     for j in module.computations[i.attr("body").lstrip("%")].instrs)]
    assert len(loops) == 1, [i.name for i in loops]
    return loops[0], module.computations[loops[0].attr("body").lstrip("%")]


def _tick_copies(module, body) -> tuple[int, int]:
    """(bytes the tick body and its switches' idle branches copy, the most any other branch
    copies), not counting what they call (the layer scans' own loops, fusions). A pool copied
    through a switch shows in all of them: an idle branch only passes the pools on. A fused
    tick table has one switch per lane."""
    switches = [i for i in body.instrs if i.opcode == "conditional"]
    assert switches

    def copied(comp) -> int:
        return sum(i.result_bytes for i in comp.instrs if i.opcode in ("copy", "copy-start"))

    passed, worked = copied(body), 0
    for switch in switches:
        idle, *work = (module.computations[c] for c in switch.called)
        passed, worked = passed + copied(idle), max(worked, *map(copied, work))
    return passed, worked


def test_transfers_neighbours_and_one_data_reduction(one_f_one_b):
    module = hlo.parse_module(one_f_one_b.as_text())
    entry = module.computations[module.entry]
    loops = [i for i in _walk(module, entry) if i.opcode == "while"
             and (module.trip_count(i) or 0) > 8]
    assert loops, "no tick loop"
    body = module.computations[loops[0].attr("body").lstrip("%")]
    inside = list(_walk(module, body))
    permutes = [i for i in inside if i.opcode.startswith("collective-permute")]
    assert permutes
    for ins in permutes:
        for src, dst in hlo.source_target_pairs(ins):
            assert src // 4 == dst // 4 and abs(src % 4 - dst % 4) == 1, (src, dst)

    def over_data(ins):
        return any(len({d // 4 for d in g}) > 1 for g in hlo.replica_groups(ins, 8))

    reductions = ("all-reduce", "reduce-scatter")
    assert not [i for i in inside if i.opcode.startswith(reductions) and over_data(i)]
    everywhere = [i for i in _walk(module, entry) if i.opcode.startswith(reductions)
                  and over_data(i)]
    assert everywhere, "the data-parallel reduction is missing"


def test_no_stage_stacked_gradient_buffer(one_f_one_b):
    """A per-device [S, ...] copy of a block parameter (the stacked-gradient trap) would show as
    an array with a leading dim of 4 and a block weight's trailing shape; the local blocks are
    [1, 1, 1, ...] (one chunk of one layer per stage)."""
    text = one_f_one_b.as_text()
    assert "f32[1,1,1,128,512]" in text  # the local block weight: the pattern is right
    assert "f32[4,1,1,128,512]" not in text and "f32[4,1,128,512]" not in text


@pytest.mark.slow
def test_one_f_one_b_memory_is_flat_in_m_gpipe_grows():
    temp = {(s, m): _compile(s, m).memory_analysis().temp_size_in_bytes
            for s in ("1f1b", "gpipe") for m in (8, 16)}
    assert temp[("1f1b", 16)] < 1.05 * temp[("1f1b", 8)], temp
    assert temp[("gpipe", 16)] > 1.5 * temp[("gpipe", 8)], temp


@pytest.mark.slow
def test_spmd_one_f_one_b_memory_flat_but_for_the_embeddings():
    """1f1b_spmd keeps min(M, 2S-1) stage inputs and one micro-batch's residuals: from M=8 to
    16 its temporary memory grows by at most its two [M, B, L, D] float32 buffers (the
    micro-batches' embeddings and their gradients, 2 x 8 x 4 x 64 x 128 x 4 bytes more), where
    gpipe_spmd's grows with every micro-batch's residuals; it also has no conditional."""
    temp = {(s, m): _compile(s, m).memory_analysis().temp_size_in_bytes
            for s in ("1f1b_spmd", "gpipe_spmd") for m in (8, 16)}
    embeddings = 2 * 8 * 4 * 64 * CFG.d_model * 4
    assert temp[("1f1b_spmd", 16)] <= 1.05 * temp[("1f1b_spmd", 8)] + embeddings, temp
    assert temp[("gpipe_spmd", 16)] > 1.5 * temp[("gpipe_spmd", 8)], temp
    assert temp[("1f1b_spmd", 16)] < temp[("gpipe_spmd", 8)] / 2, temp
    module = hlo.parse_module(_compile("1f1b_spmd", 8).as_text())
    every = list(_walk(module, module.computations[module.entry]))
    assert not [i for i in every if i.opcode == "conditional"]
    for ins in every:
        if ins.opcode.startswith("collective-permute") and not ins.opcode.endswith("-done"):
            for src, dst in hlo.source_target_pairs(ins):
                assert src // 4 == dst // 4 and abs(src % 4 - dst % 4) == 1, (src, dst)


def _inside_the_switch(mesh: str, rules: str, schedule: str, m: int) -> list:
    """Every instruction inside the branches of the tick's conditional of the compiled 1F1B
    step (and what they call)."""
    spec = CompileSpec(model=CFG, parallel=ParallelConfig(mesh=mesh, rules=rules,
                                                          schedule=schedule,
                                                          pipeline=PipelineConfig(schedule="1f1b")),
                       batch_size=4 * m, seq_len=64, microbatches=m)
    module = hlo.parse_module(lower(spec, make_mesh(mesh, jax.devices())).compile().as_text())
    switches = [i for i in _walk(module, module.computations[module.entry])
                if i.opcode == "conditional"]
    assert switches, "no tick switch"
    return [i for sw in switches for c in sw.called if c in module.computations
            for i in _walk(module, module.computations[c])]


@pytest.mark.parametrize("schedule", ["megatron", "megatron_sp", "oases"])
def test_no_collective_permute_inside_the_switch(schedule):
    """Devices of different stages take different branches of the tick's conditional, so the
    collectives inside a branch must rendezvous over the stage's own devices (tensor-group
    all-reduces, all-gathers, reduce-scatters): a collective-permute there waits for every
    device, and the CPU runtime deadlocked on sequence parallelism's token shift."""
    inside = _inside_the_switch("stage=2,tensor=4", "tp", schedule, 2)
    assert any(i.opcode.startswith(("all-reduce", "all-gather", "reduce-scatter"))
               for i in inside), "no tensor-parallel collective inside the branches"
    assert not [i.name for i in inside if i.opcode.startswith("collective-permute")]


def test_fsdp_gathers_inside_the_branches():
    """`--rules fsdp` inside the stages is FSDP: the tick's branches all-gather the weights
    over `data` and reduce their gradients there (GSPMD's all-reduce and slice, per
    micro-batch, as ZeRO-3 does), rather than the step gathering every weight once before
    the loop; no collective-permute inside the switch."""
    inside = _inside_the_switch("data=2,stage=4", "fsdp", "megatron", 4)
    gathered = [i for i in inside if i.opcode.startswith("all-gather")]
    # The MLP's input projection, [D, F] = [128, 512]: gathered from its [64, 512] shards.
    assert any(i.type_text.startswith(("f32[128,512]", "f32[512,128]")) for i in gathered)
    assert any(i.opcode.startswith(("all-reduce", "reduce-scatter")) for i in inside)
    assert not [i.name for i in inside if i.opcode.startswith("collective-permute")]


@pytest.mark.parametrize("target", ["cpu", pytest.param("h100:8", marks=pytest.mark.gpu_aot)])
def test_weights_cast_before_the_tick_loop(target):
    """bf16 compute: the block weights and the head's vocabulary table (tied: the embedding's)
    are cast once, before the tick loop (`stage_program`'s `prepare`); the tick's branches
    convert no float32 weight to bf16. Each cast inside a branch was a pass over the weights
    every tick (before the head table moved out: two converts of f32[V, D] in the branches)."""
    import re

    from oases_jax.targets import get_target, has_gpu_aot

    if target != "cpu" and not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    cfg = CFG.replace(dtype="bfloat16")
    devices = jax.devices() if target == "cpu" else get_target(target).devices
    spec = CompileSpec(model=cfg, parallel=ParallelConfig(mesh="stage=4", rules="tp",
                                                          schedule="megatron",
                                                          pipeline=PipelineConfig(schedule="1f1b")),
                       batch_size=16, seq_len=64, microbatches=4)
    module = hlo.parse_module(lower(spec, make_mesh("stage=4", devices[:4])).compile().as_text())
    entry = module.computations[module.entry]
    V, D = cfg.padded_vocab, cfg.d_model

    by_name = {i.name: i for c in module.computations.values() for i in c.instrs}
    moved = ("parameter", "get-tuple-element", "dynamic-slice", "slice", "copy", "bitcast")

    def weight_casts(instrs) -> list[str]:
        """Converts to bf16 of a float32 weight as stored (the [V, D] table, a block matrix),
        not of a gradient computed in the branch."""
        out = []
        for i in instrs:
            shape = re.match(r"bf16\[([\d,]+)\]", i.type_text)
            src = by_name.get(i.operands[0]) if i.operands else None
            if i.opcode == "convert" and shape and src is not None and src.opcode in moved:
                dims = tuple(map(int, shape.group(1).split(",")))
                if dims == (V, D) or (len(dims) >= 2 and dims[-2:] in {(128, 512), (512, 128)}):
                    out.append(i.name)
        return out

    switches = [i for i in _walk(module, entry) if i.opcode == "conditional"]
    assert switches, "no tick switch"
    inside = [i for sw in switches for c in sw.called if c in module.computations
              for i in _walk(module, module.computations[c])]
    assert not weight_casts(inside)
    assert weight_casts(_walk(module, entry)), "the casts before the loop are missing"


@pytest.mark.gpu_aot
@pytest.mark.parametrize("pipeline", ["gpipe_spmd", "1f1b_spmd"])
def test_primepar_square_inside_stages_compiles_for_gpus(pipeline):
    """PrimePar's square inside both SPMD pipelines compiles for an H100 node (gpipe_spmd is
    refused only on CPU devices, whose collectives deadlock on it): no tick switch, the
    square's rotations asynchronous, each stage transfer one stage in one direction, and the
    CPU refusal does not fire."""
    from oases_jax.targets import get_target, has_gpu_aot

    if not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    mesh_text = "stage=2,tp_row=2,tp_col=2"  # device d: stage d // 4
    # cuDNN's attention does not partition inside the stage loop (docs/parallelism.md).
    spec = CompileSpec(model=CFG.replace(dtype="bfloat16", attention="xla"),
                       parallel=ParallelConfig(mesh=mesh_text, rules="primepar",
                                               schedule="primepar",
                                               pipeline=PipelineConfig(schedule=pipeline)),
                       batch_size=16, seq_len=64, microbatches=4)
    mesh = make_mesh(mesh_text, get_target("h100:8").devices)
    module = hlo.parse_module(lower(spec, mesh).compile().as_text())
    instrs = [i for c in module.computations.values() for i in c.instrs]
    assert not [i for i in instrs if i.opcode == "conditional"]
    starts = [i for i in instrs if i.opcode == "collective-permute-start"]
    assert starts
    pairs = [hlo.source_target_pairs(i) for i in starts]
    across = [p for p in pairs if p and all((a // 4) != (b // 4) for a, b in p)]
    within = [p for p in pairs if p and all((a // 4) == (b // 4) for a, b in p)]
    assert within, "no rotation inside the square"
    # Stage transfers move one stage, one direction per permute: no wrap-around edge.
    assert across and all({b // 4 - a // 4 for a, b in p} in ({1}, {-1}) for p in across)


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved"])
def test_no_pool_copied_every_tick(schedule):
    """The residual pools go through the tick's switch in place: the program compiles with copy
    insertion by region analysis (`pools.compiler_options`). Without it XLA:CPU copied every
    pool after the switch, every tick (39 MiB a tick per device at M=16, stage=2 on `small`),
    and every branch copied them too. Interleaved runs its fused tick table (two switches a
    tick, `--fused-ticks`), whose lanes pass the pools on in place too. The copies of the tick
    body and its idle branches must come to under 5% of what the loop carries (they were
    72-88% each, with the idle branch's pass over the same pools), and a working branch's to
    under 10% (72-94%; what stays is one micro-batch's residuals on their way into the pools,
    5.6%)."""
    devices = jax.devices()
    m = 8
    spec = CompileSpec(model=CFG, parallel=ParallelConfig(mesh="stage=2", rules="tp",
                                                          schedule="megatron",
                                                          pipeline=PipelineConfig(schedule=schedule)),
                       batch_size=2 * m, seq_len=64, microbatches=m)
    module = hlo.parse_module(lower(spec, make_mesh("stage=2", devices[:2])).compile().as_text())
    loop, body = _tick_loop(module)
    carried = loop.result_bytes
    passed, worked = _tick_copies(module, body)
    assert carried > 4 * 2**20  # the pools of 8 micro-batches
    assert passed < 0.05 * carried and worked < 0.1 * carried, (passed, worked, carried)


@pytest.mark.gpu_aot
@pytest.mark.slow
@pytest.mark.parametrize("pipeline", ["gpipe", "merak"])
def test_gpu_tick_body_transposes_and_copies_no_pool(pipeline):
    """Compiled for GPUs, the switch returns the residual pools in the loop carry's layout. The
    branches load a slot with a gather: with a dynamic slice, XLA's layout assignment carried
    the layout a weight-gradient GEMM wants for its residual (token-minor) back to the whole
    pool, every branch (IDLE included) wrote the pool transposed and the tick body transposed
    it back (GPT-2 1.5B, stage=2,data=4,tensor=2, GPipe M=8 on `h100:16`: 250.9 ms, 182.6 with
    the gather). Here GPT-2 1.5B's width on 4 layers, one row per micro-batch: nothing in the
    tick body but copies writes a buffer of 16 MiB or more (a transpose fusion of the
    `bf16[32,2,1,1024,1600]` pool did). And the pools are not copied: with a mesh axis left
    to GSPMD inside the stages (`tensor`), XLA:GPU's default copy insertion kept a copy of
    every pool in every branch and another after the switch, every tick (1F1B at
    data=2,stage=2,tensor=4, M=8: 226.6 ms, 197.2 with region analysis,
    `pools.compiler_options`); the body's and idle branch's copies stay under 5% of the carry,
    a working branch's under 10%. Merak's pools hold one row (a stage frees its residuals
    before the next micro-batch's): updated whole, the pool took the producer's layout
    (attention probabilities key-major) and every idle lane transposed it back, as did the
    tick body (0.94 ms each on 24 layers a stage); `executor.store` writes it with a select,
    so neither the body nor an idle branch writes a large buffer. Its three lanes' idle
    branches still copy the one-row attention-mask pool (10 MiB) and the two sends (3 MiB
    each): 6.9% of the carry, held under 10%."""
    from oases_jax.targets import get_target, has_gpu_aot

    if not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    mesh_text, m = "stage=2,data=2,tensor=2", 8
    cfg = get_preset("gpt2-1.5b").replace(n_layers=4, n_heads=20, dtype="bfloat16",
                                          attention="xla")
    spec = CompileSpec(model=cfg, parallel=ParallelConfig(mesh=mesh_text, rules="tp",
                                                          schedule="megatron",
                                                          pipeline=PipelineConfig(schedule=pipeline)),
                       batch_size=2 * m, seq_len=1024, microbatches=m)
    mesh = make_mesh(mesh_text, get_target("h100:8").devices)
    module = hlo.parse_module(lower(spec, mesh).compile().as_text())
    loop, body = _tick_loop(module)
    passive = ("get-tuple-element", "tuple", "bitcast", "conditional", "parameter", "copy",
               "copy-start", "copy-done")
    idle = [module.computations[i.called[0]] for i in body.instrs if i.opcode == "conditional"]
    big = [(comp.name, i.opcode, i.type_text[:60]) for comp in (body, *idle)
           for i in comp.instrs if i.opcode not in passive and i.result_bytes >= 2**24]
    assert not big, big
    (passed, worked), carried = _tick_copies(module, body), loop.result_bytes
    bound = 0.1 if pipeline == "merak" else 0.05
    assert passed < bound * carried and worked < 0.1 * carried, (passed, worked, carried)
