"""Compiled-program contracts of the MoE schedules on deviceless GPU targets: small-moe's bf16
train step (2 MoE layers, batch 16 x 256) compiled through the one compile path for 8 H100s
(expert=2,tensor=4: one node) and 32 H100s (expert=4,tensor=8: the all-to-all crosses 4 nodes,
each MP/ESP group is one node), read from the scheduled HLO. Runs without a GPU."""

import functools
import re

import pytest

from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.moe import cost as cost
from oases_jax.targets import has_gpu_aot
from oases_jax.tools.analysis import moe_program as mp
from oases_jax.tools.analysis.program import analyze
from oases_jax.training.config import ParallelConfig
from oases_jax.training.program import CompileSpec, lower

pytestmark = [pytest.mark.gpu_aot, pytest.mark.slow,
              pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")]

BATCH, SEQ = 16, 256
TARGETS = {"h100:8": "expert=2,tensor=4", "h100:32": "expert=4,tensor=8"}
MODEL = get_preset("small-moe").replace(dtype="bfloat16")
# XLA's default combiners: merge every all-gather and reduce-scatter they can.
COMBINE = {"xla_gpu_all_gather_combine_threshold_bytes": 1 << 30,
           "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 30}


@functools.cache
def _compiled(target_name: str, schedule: str, chunks: int = 0, combine: bool = False):
    """(analysis, program, options) of the train step, compiled once per module."""
    from oases_jax.targets import get_target

    mesh_text = TARGETS[target_name]
    mesh = make_mesh(mesh_text, get_target(target_name).devices)
    spec = CompileSpec(model=MODEL, batch_size=BATCH, seq_len=SEQ, parallel=ParallelConfig(
        mesh=mesh_text, rules="tp", schedule="megatron", moe_schedule=schedule,
        moe_chunks=chunks))
    prog = lower(spec, mesh)
    compiled = prog.compile(COMBINE if combine else None)
    analysis, program = analyze(compiled, mesh)
    return analysis, program, prog.options


def _sizes(target_name) -> tuple[int, int]:
    """(N_EP, N_MP) of the target's mesh."""
    sizes = dict(a.split("=") for a in TARGETS[target_name].split(","))
    return int(sizes["expert"]), int(sizes["tensor"])


def _shape(target_name) -> cost.LayerShape:
    ep, mpn = _sizes(target_name)
    return cost.LayerShape(tokens=BATCH * SEQ // ep, d_model=MODEL.d_model,
                           d_ff=MODEL.expert_ff_dim, experts=MODEL.n_experts, top_k=MODEL.top_k,
                           capacity_factor=MODEL.capacity_factor, dtype_bytes=2, ep=ep, mp=mpn)


def _router_rows(program) -> set[int]:
    """Rows of the forward router GEMMs ("td,de->te", float32 logits [rows, E])."""
    rows = set()
    for comp in program.module.computations.values():
        for instr in comp.instrs:
            op_name = re.search(r'op_name="([^"]*)"', instr.attrs)
            if (instr.opcode == "dot" and op_name and "td,de->te" in op_name.group(1)
                    and "transpose" not in op_name.group(1)):
                (shape,) = instr.shapes
                assert shape.dtype == "f32" and shape.dims[-1] == MODEL.n_experts
                rows.add(shape.dims[0])
    return rows


def _moe_all_reduces(analysis, program) -> list:
    """All-reduces of activations whose nearest upstream collectives include an all-to-all over
    `expert`: collectives on the MoE path after the combine (ds_moe's restoring sum)."""
    out = []
    for c in analysis.collectives:
        if c.kind != "all-reduce" or c.bytes < 1024:
            continue
        sp = mp.spans(program, c.computation)
        names = {n for n, s in sp.items() if s.collective.bytes >= 1024}
        up = mp.upstream_collectives(program, c.computation, c.name, names)
        if any(sp[u].collective.kind == "all-to-all" for u in up):
            out.append(c)
    return out


@pytest.mark.parametrize("target_name", TARGETS)
def test_s1_gates_each_token_once_and_all_reduces_nothing_on_the_moe_path(target_name):
    ep, mpn = _sizes(target_name)
    t = BATCH * SEQ // ep  # tokens per MP group
    analysis, program, _ = _compiled(target_name, "parm_s1")
    assert _router_rows(program) == {t // mpn}  # de-duplicated: T / N_MP rows per device
    assert _moe_all_reduces(analysis, program) == []
    if target_name == "h100:8":
        # The baseline the checks tell apart: T rows, and per layer two [T, D] sums over tensor
        # (the forward's restoring sum; the backward's sum of the duplicated tokens' partial
        # input gradients).
        analysis, program, _ = _compiled(target_name, "ds_moe")
        assert _router_rows(program) == {t}
        sums = _moe_all_reduces(analysis, program)
        # [T, D] bf16, in the backward combined with a few router-statistics bytes
        assert all(t * MODEL.d_model * 2 <= c.bytes < t * MODEL.d_model * 2 + 16384
                   for c in sums), [c.bytes for c in sums]
        assert sum(c.count for c in sums) == 2 * MODEL.n_moe_layers


@pytest.mark.parametrize("target_name", TARGETS)
@pytest.mark.parametrize("schedule, chunks", [("parm_s1", 1), ("parm_s2", 2)])
def test_moe_collective_bytes_equal_the_cost_model(target_name, schedule, chunks):
    """Per layer, forward and backward alike: 2 * chunks all-to-alls over expert, chunks ESP
    all-gathers and reduce-scatters over tensor, of the cost model's bytes exactly."""
    analysis, program, _ = _compiled(target_name, schedule, chunks if chunks > 1 else 0)
    model = {(c.kind, c.axis): c for c in cost.collectives(_shape(target_name), schedule,
                                                            chunks, restore=False)}
    got = mp.moe_collectives(program)
    passes = 2 * MODEL.n_moe_layers  # forward and backward of each MoE layer
    a2a, ag = model["all-to-all", "expert"], model["all-gather", "tensor"]
    rs = model["reduce-scatter", "tensor"]
    assert got == {
        "all-to-all@expert": {"count": passes * a2a.count, "sizes": [a2a.nbytes],
                              "bytes": passes * a2a.count * a2a.nbytes},
        "esp-all-gather@tensor": {"count": passes * ag.count, "sizes": [ag.nbytes],
                                  "bytes": passes * ag.count * ag.nbytes},
        "esp-reduce-scatter@tensor": {"count": passes * rs.count, "sizes": [rs.nbytes],
                                      "bytes": passes * rs.count * rs.nbytes}}


@pytest.mark.parametrize("target_name", TARGETS)
def test_s2_chunk_all_gather_runs_beside_the_next_chunks_all_to_all(target_name):
    """In the forward and in the backward of the MoE layers (the scan's two loop bodies), each
    chunk's ESP all-gather starts before the next chunk's all-to-all completes, both
    asynchronous."""
    _, program, options = _compiled(target_name, "parm_s2", 2)
    assert options["xla_gpu_all_gather_combine_threshold_bytes"] == 0
    pipes = mp.pipelines(program)
    assert len(pipes) == 2, [p.computation for p in pipes]  # forward and backward bodies
    for pipe in pipes:
        assert len(pipe.chunks) == 2 and pipe.overlapped == (True,), pipe.to_json()
        (_, ag0), (a2a1, _) = pipe.chunks
        assert ag0.is_async and a2a1.is_async and ag0.start < a2a1.done


def test_s2_needs_its_combiner_options_on_h100():
    """Why parm_s2 turns XLA's all-gather and reduce-scatter combiners off: with them XLA merges
    the chunks' ESP all-gathers into one that waits for every chunk's all-to-all, so no chunk's
    all-gather runs beside another chunk's all-to-all (the bytes moved are the same)."""
    analysis, program, _ = _compiled("h100:8", "parm_s2", 2, combine=True)
    assert mp.pipelines(program) == []
    ag = {(c.kind, c.axis): c for c in cost.collectives(_shape("h100:8"), "parm_s2", 2,
                                                        restore=False)}
    merged = [c for c in analysis.collectives if c.kind == "all-gather" and c.axes == ("tensor",)
              and c.bytes == 2 * ag["all-gather", "tensor"].nbytes]
    assert sum(c.count for c in merged) == 2 * MODEL.n_moe_layers


def test_inspection_report_names_the_moe_collectives_and_the_chunk_overlap():
    """What inspect_hlo.py prints for S2 on h100:8: per-layer bytes and the chunk pairs."""
    from oases_jax.tools.report import moe_lines

    _, program, _ = _compiled("h100:8", "parm_s2", 2)
    moe = mp.report(program, MODEL.n_moe_layers)
    a2a = {(c.kind, c.axis): c for c in cost.collectives(_shape("h100:8"), "parm_s2", 2,
                                                         restore=False)}["all-to-all", "expert"]
    # forward and backward: 2 chunks x (dispatch + combine) all-to-alls each
    assert moe["per_layer_bytes"]["all-to-all@expert"] == 2 * a2a.count * a2a.nbytes
    lines = moe_lines({"moe": moe, "moe_schedule": "parm_s2", "moe_chunks": 2})
    assert lines[0] == ("MoE (MoE layers: 2, --moe-schedule parm_s2, 2 chunks): per step / "
                        "per MoE layer")
    assert sum("all-gather of chunk i beside the all-to-all of chunk i+1: 1/1 pairs overlap"
               in ln for ln in lines) == 2, lines
