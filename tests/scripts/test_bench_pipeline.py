"""bench.py with pipeline schedules side by side (`--pipeline`): every variant's pipeline is
checked against the model and the micro-batches before anything compiles, the table gains a
pipeline column, and a real run times each schedule on the same batches against the first."""

import dataclasses
import json

import pytest

from oases_jax.errors import UserError
from oases_jax.models import get_preset
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.tools.bench import BenchConfig, VariantSpec, format_table, resolve_variants
from tests.scripts.test_bench import DATA, run_bench_cli


def piped(*schedules: str, mesh: str = "data=4,stage=2", settings=None, **kw) -> BenchConfig:
    """One variant per pipeline schedule, each `PipelineConfig(schedule, **settings)`."""
    kw = {"batch_size": 16, "seq_len": 32, "microbatches": 4, "warmup": 1, "rounds": 2,
          "steps_per_round": 1, "data": DATA} | kw
    variants = tuple(VariantSpec(mesh=mesh, pipeline=PipelineConfig(schedule=s,
                                                                     **(settings or {})))
                     for s in schedules)
    return BenchConfig(model=get_preset("tiny"), model_name="tiny", variants=variants, **kw)


def test_labels_are_the_schedules():
    cfg = piped("gpipe", "1f1b", "merak")
    rows = resolve_variants(cfg.variants, 8, cfg)
    assert [(r.label, r.pipeline, r.mesh) for r in rows] == [
        ("gpipe", "gpipe", "data=4,stage=2"), ("1f1b", "1f1b", "data=4,stage=2"),
        ("merak", "merak", "data=4,stage=2")]


@pytest.mark.parametrize("overrides, needles", [
    ({"microbatches": 1}, ("variant data=4,stage=2/tp/megatron/merak", "M >= 2")),  # M >= S
    ({"mesh": "data=8"}, ("variant data=8/tp/megatron/1f1b", "stage axis")),
    ({"settings": {"remat_ratios": (0.5, 0.5, 0.5)}}, ("/1f1b", "3 recompute ratios", "S=2")),
])
def test_bad_pipeline_is_one_line_before_compiling(overrides, needles):
    mesh = overrides.pop("mesh", "data=4,stage=2")
    cfg = piped("1f1b", "merak", mesh=mesh, **overrides)
    with pytest.raises(UserError) as e:
        resolve_variants(cfg.variants, 8, cfg)
    assert "\n" not in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def test_every_pipeline_with_every_schedule_named():
    """`--pipeline A,B --schedules X,Y`: one variant per pair (the rings run under
    gpipe_spmd); a pair the pipeline cannot run exits 2 naming it, before any compile."""
    from oases_jax.scripts.bench import build_config, parse_args

    args = ["--model", "tiny", "--mesh", "stage=2,tensor=4", "--microbatches", "4",
            "--batch-size", "16", "--seq-len", "32", "--data", str(DATA)]
    cfg = build_config(parse_args([*args, "--pipeline", "gpipe_spmd",
                                   "--schedules", "megatron,collective_matmul"]))
    assert [(v.pipeline.schedule, v.schedule) for v in cfg.variants] == [
        ("gpipe_spmd", "megatron"), ("gpipe_spmd", "collective_matmul")]
    cfg = build_config(parse_args([*args, "--pipeline", "gpipe,gpipe_spmd",
                                   "--schedules", "collective_matmul"]))
    with pytest.raises(UserError) as e:
        resolve_variants(cfg.variants, 8, cfg)
    assert "/gpipe" in str(e.value) and "collective_matmul" in str(e.value), str(e.value)


def test_batch_must_split_into_microbatches():
    with pytest.raises(UserError, match="--microbatches 3"):
        piped("1f1b", microbatches=3)


def test_table_has_a_pipeline_column():
    row = {"label": "1f1b", "mesh": "data=4,stage=2", "rules": "tp", "schedule": "megatron",
           "pipeline": "1f1b", "compile_s": 1.0, "median_s": 0.01, "min_s": 0.01,
           "max_s": 0.01, "tokens_per_s": 100.0, "mfu": None, "ratio": 1.0, "samples": [0.01]}
    report = {"model": "tiny", "dtype": "float32", "batch_size": 16, "seq_len": 32,
              "microbatches": 4, "n_devices": 8, "device": "cpu", "variants": [row]}
    lines = format_table(report).splitlines()
    assert "in 4 micro-batches" in lines[0] and "pipeline" in lines[1].split()
    assert lines[3].split()[4] == "1f1b"


@pytest.mark.slow
def test_cli_times_pipeline_schedules_side_by_side(tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bench_cli(
        *("--model", "tiny", "--batch-size", "16", "--seq-len", "32", "--warmup", "1"),
        *("--rounds", "2", "--steps-per-round", "1", "--pipeline", "gpipe,1f1b"),
        *("--mesh", "data=4,stage=2", "--microbatches", "4", "--data", DATA),
        *("--json", str(out)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["variants"]
    assert [(r["label"], r["pipeline"]) for r in rows] == [("gpipe", "gpipe"), ("1f1b", "1f1b")]
    assert report["microbatches"] == 4 and rows[0]["ratio"] == 1.0
    assert rows[1]["ratio"] == pytest.approx(rows[1]["median_s"] / rows[0]["median_s"])
    assert "pipeline" in proc.stdout and "1f1b" in proc.stdout


def _plan_files(tmp_path, n=2):
    """The 3D search's best `n` plans of `tiny` for cpu-8 (batch 16 x 32), as plan files."""
    from oases_jax.hardware import get_cluster
    from oases_jax.planner import plan as plans
    from oases_jax.planner.cost.prices import Hardware
    from oases_jax.planner.search.pipeline import search_3d

    cfg = get_preset("tiny")
    cands = search_3d(cfg, Hardware.of(get_cluster("cpu-8")), global_batch=16, seq_len=32)
    paths = []
    for i, c in enumerate(cands[:n]):
        paths.append(tmp_path / f"plan{i}.json")
        plans.save(plans.pipeline_plan_json(c, model="tiny", cfg=cfg, cluster="cpu-8",
                                            cost_source="datasheet", search_s=0.0), paths[-1])
    return cands[:n], paths


def test_plan_variants_carry_their_own_pipeline_and_microbatches(tmp_path):
    """A plan's variant runs the plan's parallel config and micro-batch count, whatever the
    bench-wide --microbatches, and the pipeline checks use them before anything compiles."""
    from oases_jax.planner import plan as plans

    cands, paths = _plan_files(tmp_path)
    specs = []
    for p in paths:
        plan = plans.load(p)
        par = plan.parallel()
        specs.append(VariantSpec(mesh=par.mesh, rules=par.rules, schedule=par.schedule,
                                 label=p.stem, pipeline=par.pipeline, parallel=par,
                                 microbatches=plan.microbatches))
    cfg = BenchConfig(model=get_preset("tiny"), model_name="tiny", variants=tuple(specs),
                      batch_size=16, seq_len=32, microbatches=1, data=DATA)
    rows = resolve_variants(cfg.variants, 8, cfg)
    for row, c in zip(rows, cands, strict=True):
        assert row.pipeline == c.stage_plan.schedule
        assert row.microbatches(cfg) == c.layout.microbatches
    bad = dataclasses.replace(specs[0], microbatches=5)
    with pytest.raises(UserError, match="does not split into 5 micro-batches"):
        BenchConfig(model=get_preset("tiny"), variants=(bad,), batch_size=16, seq_len=32)


@pytest.mark.slow
def test_cli_measures_plans_beside_their_predictions(tmp_path):
    cands, paths = _plan_files(tmp_path)
    out = tmp_path / "bench.json"
    base = ("--model", "tiny", "--batch-size", "16", "--seq-len", "32", "--data", DATA)
    proc = run_bench_cli(*base, "--warmup", "1", "--rounds", "2", "--steps-per-round", "1",
                         *(a for p in paths for a in ("--plan", str(p))),
                         "--predict", "datasheet", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["variants"]
    assert [r["label"] for r in rows] == [p.stem for p in paths]
    for r, c in zip(rows, cands, strict=True):
        assert r["pipeline"] == c.stage_plan.schedule
        assert r["microbatches"] == c.layout.microbatches
        assert r["predicted_s"] == pytest.approx(c.step_s) and r["median_s"] > 0
    assert "Spearman rank correlation over 2 variants" in proc.stdout
    proc = run_bench_cli("--model", "tiny", "--batch-size", "8", "--seq-len", "32",
                         "--plan", str(paths[0]))
    assert proc.returncode == 2
    assert "global batch of 16, not 8: pass --batch-size 16" in proc.stderr.strip()


def test_fused_ticks_variants_side_by_side():
    """`--fused-ticks on,off`: every pipeline variant once per tick table, labelled by it; an
    unknown value exits 2 naming it."""
    from oases_jax.scripts.bench import build_config, parse_args

    args = ["--model", "tiny", "--mesh", "data=4,stage=2", "--microbatches", "4",
            "--batch-size", "16", "--seq-len", "32", "--data", str(DATA),
            "--pipeline", "1f1b,merak"]
    cfg = build_config(parse_args([*args, "--fused-ticks", "on,off"]))
    assert [(v.pipeline.schedule, v.pipeline.fused_ticks) for v in cfg.variants] == [
        ("1f1b", True), ("1f1b", False), ("merak", True), ("merak", False)]
    rows = resolve_variants(cfg.variants, 8, cfg)
    assert [r.label for r in rows] == ["1f1b/fused", "1f1b/unfused", "merak/fused",
                                       "merak/unfused"]
    proc = run_bench_cli(*args, "--fused-ticks", "on,maybe")
    assert proc.returncode == 2
    assert "unknown --fused-ticks 'maybe': give auto, on or off" in proc.stderr.strip()
