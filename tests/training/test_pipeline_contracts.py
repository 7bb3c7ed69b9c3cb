"""Stage-aware recomputation in the compiled program (CPU, through training/program.py): each
stage's recompute FLOPs, read from the tick loop's branch computations
(`analysis.pipeline_stages`), are r_i x its forward FLOPs x the share of a layer's forward GEMMs a
backward re-runs, and the last stage's are 0; each stage's residual bytes are what its slots
hold in the compiled pools; the per-stage timeline picture is written."""

from __future__ import annotations

from fractions import Fraction

import jax
import numpy as np
import pytest

from oases_jax.hardware import get_cluster
from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.tools.analysis import pipeline_plot, pipeline_stages
from oases_jax.tools.analysis.pipeline_time import pipeline_time
from oases_jax.tools.analysis.program import analyze
from oases_jax.tools.pipeline_report import stage_account, stage_layouts, step_plan
from oases_jax.training import ParallelConfig
from oases_jax.training.program import CompileSpec, lower

MESH, LAYERS, SEQ = "data=2,stage=4", (5, 10, 5, 1), 16
# n_i x r_i is a whole number of layers on every stage: Merak's rule from r0 = 0.8 gives
# 0.8, 0.7, 0.4, 0 -> 4, 7, 2, 0 layers; the explicit list 0.6, 0.3, 1, 0 -> 3, 3, 5, 0.
CFG = get_preset("tiny").replace(n_layers=21, d_model=32, d_ff=128)


def rerun_share(cfg=CFG, seq=SEQ) -> float:
    """The share of a layer's forward GEMM FLOPs its backward re-runs under full remat: all but
    the MLP's down projection, whose output the backward never reads. Per token: QKV 6D^2,
    attention out 2D^2, MLP 2DF up and 2DF down, scores and values 2LD each."""
    d, f = cfg.d_model, cfg.d_ff
    return 1 - 2 * d * f / (8 * d * d + 4 * d * f + 4 * seq * d)


def compiled(ratios: tuple[float | Fraction, ...] | None, backward_ticks: int = 0,
             remat: str = "none", pipeline: str = "1f1b"):
    pipe = PipelineConfig(schedule=pipeline, stage_layers=LAYERS, remat_ratios=ratios,
                          backward_ticks=backward_ticks)
    spec = CompileSpec(model=CFG.replace(remat=remat), batch_size=8, seq_len=SEQ, microbatches=4,
                       parallel=ParallelConfig(mesh=MESH, rules="tp", schedule="megatron",
                                               pipeline=pipe))
    mesh = make_mesh(MESH, jax.devices())
    analysis, program = analyze(lower(spec, mesh).compile(), mesh)
    return spec, mesh, analysis, program


@pytest.fixture(scope="module")
def merak_rule():
    """Merak's rule from r0 = 0.8, one tick per backward (the fewest branches to compile)."""
    spec, mesh, analysis, program = compiled((Fraction(4, 5),), backward_ticks=1)
    return spec, mesh, analysis, program, stage_account(spec, mesh, program,
                                                        analysis.peak_memory_bytes)


def _check_ratios(account: dict, ratios) -> None:
    f = account["flops"]
    rec, fwd = np.array(f["recompute"]), np.array(f["forward"])
    assert (fwd > 0).all() and f["recompute_r"] == [0.0] * 4  # 1F1B: no R branches
    c = rerun_share()
    for i, r in enumerate(ratios):
        if r == 0:
            assert rec[i] == 0, (i, rec)
        else:
            assert rec[i] / fwd[i] == pytest.approx(float(r) * c, rel=0.05), (i, rec / fwd)


def test_recompute_is_the_ratio_of_the_forward_merak_rule(merak_rule):
    *_, account = merak_rule
    ratios = PipelineConfig(schedule="1f1b", remat_ratios=(Fraction(4, 5),)).ratios_for(4)
    assert [float(r) for r in ratios] == [0.8, 0.7, 0.4, 0.0]
    assert account["remat_ratios"] == [0.8, 0.7, 0.4, 0.0]
    _check_ratios(account, ratios)


def test_stage_memory_reads_the_compiled_pools(merak_rule):
    """Every residual pool the executor lays out is a buffer of the compiled tick loop (but
    those XLA folds: at most the attention's constant mask), and the pools every device
    allocates hold at least the fullest stage's slots and at most all stages' together."""
    *_, analysis, _, account = merak_rule
    m = account["memory"]
    assert account["unmatched_pools"] <= 1
    assert max(m["held_bytes"]) <= m["pool_bytes"] <= sum(m["held_bytes"])
    assert 0 < m["pool_bytes"] <= analysis.memory["temp"]
    for s in range(4):
        assert m["held_bytes"][s] == (m["res_slots"][s] * m["residual_bytes"][s]
                                      + m["stash_slots"][s] * m["stash_bytes"][s])
    assert m["res_slots"] == [4, 3, 2, 1]  # 1F1B: min(S - s, M) micro-batches in flight


def test_timeline_png_one_row_per_stage(merak_rule, tmp_path):
    pytest.importorskip("matplotlib")
    spec, mesh, _, program, _ = merak_rule
    plan, _ = step_plan(spec, mesh)
    timed = pipeline_time(program, get_cluster("h100:8"), plan)
    report = {**timed.to_json(), **pipeline_plot.timeline_json(timed)}
    # Per tick, per lane (one: Merak's table is unfused by default), per stage.
    assert len(report["rows"]) == report["ticks"] and len(report["rows"][0]) == report["lanes"]
    assert len(report["rows"][0][0]) == 4
    assert report["tick_start_s"][-1] + report["tick_s"][-1] == pytest.approx(report["loop_s"])
    out = tmp_path / "stages.png"
    pipeline_plot.draw(report, str(out), title="tiny")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


@pytest.mark.slow
def test_explicit_list_and_backward_is_twice_forward():
    """An explicit list (stage 2 recomputes all its layers, more than stage 1) under the
    default backward spans; without remat every backward does exactly twice its forward."""
    spec, mesh, analysis, program = compiled((0.6, 0.3, 1, 0))
    account = stage_account(spec, mesh, program, analysis.peak_memory_bytes)
    _check_ratios(account, [0.6, 0.3, 1, 0])
    spec, mesh, analysis, program = compiled(None)
    f = stage_account(spec, mesh, program, analysis.peak_memory_bytes)["flops"]
    assert f["recompute"] == [0.0] * 4 and f["backward"] == [2 * x for x in f["forward"]]


@pytest.mark.slow
def test_full_remat_keeps_each_layers_input():
    """Full remat keeps one [rows, L, D] input per layer per micro-batch: a middle stage's
    residual slot is exactly n_j of them, and stage 0 adds its token ids."""
    spec, mesh, analysis, program = compiled(None, remat="full")
    account = stage_account(spec, mesh, program, analysis.peak_memory_bytes)
    m, f = account["memory"], account["flops"]
    x = 8 // 4 // 2 * SEQ * CFG.d_model * 4  # rows of a micro-batch per data group, fp32
    n = list(LAYERS)
    assert m["residual_bytes"][1:3] == [n[1] * x, n[2] * x]
    assert m["residual_bytes"][0] == n[0] * x + 8 // 4 // 2 * SEQ * 4  # + int32 tokens
    assert account["unmatched_pools"] == 0
    c = rerun_share()
    assert [r / fw for r, fw in zip(f["recompute"][:3], f["forward"][:3], strict=True)] == \
        pytest.approx([c] * 3, rel=1e-6)
    residuals, stashes = stage_layouts(spec, mesh)
    assert stashes[0] == [] and all(len(stashes[j]) == 1 for j in (1, 2, 3))
    assert pipeline_stages.base_kind("B1") == "B"


def test_merak_recomputes_a_stage_once_under_full_remat():
    """Merak's schedule recomputes every stage but the last whole (its R actions). Under
    `--remat full` those stages' layers run without checkpoints, so R is their only recompute
    (before, a checkpointed layer was recomputed a second time inside the backward: 1.68x the
    forward on stage 0 of a 2-stage `small`); the last stage, which has no R, follows the policy
    inside its backward; the ratios do not apply to a stage recomputed whole."""
    spec, mesh, analysis, program = compiled((Fraction(4, 5),), backward_ticks=1, remat="full",
                                             pipeline="merak")
    f = stage_account(spec, mesh, program, analysis.peak_memory_bytes)["flops"]
    fwd, r, b = (np.array(f[k]) for k in ("forward", "recompute_r", "recompute_b"))
    assert r[:3] == pytest.approx(fwd[:3], rel=1e-6)
    assert b[:3] == pytest.approx([0.0] * 3, abs=1e-6 * fwd.max())
    assert r[3] == 0 and 0 < b[3] < rerun_share() * fwd[3]  # its one layer, not the head
