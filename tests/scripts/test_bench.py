"""tools.bench and scripts/bench.py: variant parsing, the round-robin timing on real train
steps, the report's structure and ratios, and the command line (JSON output, bad input)."""

import json
import pathlib
import statistics

import jax
import numpy as np
import pytest

from oases_jax.errors import UserError
from oases_jax.models import get_preset
from oases_jax.tools.bench import (
    BenchConfig,
    VariantSpec,
    format_table,
    parse_variant,
    prepare,
    resolve_variants,
    summarize,
    time_rounds,
    warm_up,
)
from tests.scriptrun import run_script

WARMUP, ROUNDS, PER_ROUND = 1, 2, 2
DATA = str(pathlib.Path(__file__))  # a small text corpus: loads in no time, unlike stdlib


def tiny_config(*specs: str, **kw) -> BenchConfig:
    kw = {"batch_size": 8, "seq_len": 32, "warmup": WARMUP, "rounds": ROUNDS, "data": DATA} | kw
    return BenchConfig(
        model=get_preset("tiny"),
        model_name="tiny",
        variants=tuple(parse_variant(s) for s in specs),
        steps_per_round=PER_ROUND,
        **kw,
    )


def test_parse_variant_defaults_and_label():
    assert parse_variant("data=8") == VariantSpec(mesh="data=8", rules="tp", schedule="megatron")
    assert parse_variant("data=2,tensor=4//xla_auto", rules="fsdp_tp") == VariantSpec(
        mesh="data=2,tensor=4", rules="fsdp_tp", schedule="xla_auto"
    )
    assert parse_variant("base: data=2,tensor=4/dp").label == "base"


@pytest.mark.parametrize(
    "text, needle",
    [
        ("data=2,tensor=4/tp/megatron/x", "[LABEL:]MESH"),
        ("/tp", "[LABEL:]MESH"),
        (":data=8", "empty label"),
    ],
)
def test_parse_variant_rejects_bad_syntax(text, needle):
    with pytest.raises(UserError) as e:
        parse_variant(text)
    assert needle in str(e.value) and text in str(e.value)


def test_labels_show_what_differs():
    def labels(*texts):
        return [r.label for r in resolve_variants(tuple(map(parse_variant, texts)), 8)]

    assert labels("data=2,tensor=4/tp/megatron", "data=2,tensor=4/tp/oases") == [
        "megatron",
        "oases",
    ]
    # Labels name the rule set each variant runs: xla_auto's sequence-parallel tp_sp,
    # primepar's own, not the `tp` asked for.
    assert labels("data=2,tensor=4/tp/megatron", "data=2,tensor=4/tp/xla_auto") == [
        "tp/megatron",
        "tp_sp/xla_auto",
    ]
    assert labels("data=2,tensor=4/tp/megatron", "data=2,tp_row=2,tp_col=2/tp/primepar") == [
        "d2t4/tp/megatron",
        "d2t2t2/primepar/primepar",
    ]
    assert labels("data=8,tensor=1/dp", "data=2,tensor=-1/tp") == ["d8t1/dp", "d2t4/tp"]
    same = labels("data=8", "data=8", "mine:data=8")  # nothing differs: full labels, numbered
    assert same == ["d8/tp/megatron", "d8/tp/megatron#2", "mine"]


def test_resolve_fills_mesh_and_upgrades_rules():
    (r,) = resolve_variants((parse_variant("data=-1,tensor=4//megatron_sp"),), 8)
    assert (r.mesh, r.rules, r.schedule) == ("data=2,tensor=4", "tp_sp", "megatron_sp")


@pytest.mark.parametrize(
    "text, needles",
    [
        ("data=2,tensor=4/tp/warp", ("warp", "megatron")),
        ("data=2,tensor=4/zero9", ("zero9", "tp_sp")),
        ("data=3,tensor=4", ("data=3,tensor=4", "8")),
        ("data=2,tensr=4", ("tensr",)),
    ],
)
def test_resolve_rejects_bad_values(text, needles):
    with pytest.raises(UserError) as e:
        resolve_variants((VariantSpec(mesh="data=8"), parse_variant(text)), 8)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_config_checks():
    with pytest.raises(UserError, match="--rounds 0"):
        tiny_config("data=8", rounds=0)
    with pytest.raises(UserError, match="max_seq_len"):
        tiny_config("data=8", seq_len=4096)
    with pytest.raises(UserError, match="no variants"):
        tiny_config()


@pytest.fixture(scope="module")
def bench():
    """Two tiny variants built, warmed up and timed once; host copies of the parameters and of
    batch 0 taken before timing."""
    cfg = tiny_config("data=8,tensor=1/dp", "data=2,tensor=4/tp")
    variants = prepare(cfg)
    first_batch = [np.asarray(v.batches[0]) for v in variants]
    warm_up(variants, cfg.warmup)
    before = [jax.device_get(v.state["params"]) for v in variants]
    samples = time_rounds(variants, cfg.rounds, cfg.steps_per_round)
    report = summarize(cfg, variants, samples)
    return cfg, variants, first_batch, before, report


def test_report_structure_and_ratios(bench):
    cfg, _, _, _, report = bench
    assert json.loads(json.dumps(report)) == report
    assert report["n_devices"] == 8 and report["model"] == "tiny"
    assert (report["batch_size"], report["seq_len"]) == (8, 32)
    rows = report["variants"]
    assert [r["label"] for r in rows] == ["d8t1/dp", "d2t4/tp"]
    assert [r["rules"] for r in rows] == ["dp", "tp"]
    base = rows[0]["median_s"]
    assert rows[0]["ratio"] == 1.0
    for r in rows:
        assert len(r["samples"]) == ROUNDS * PER_ROUND
        assert r["median_s"] == statistics.median(r["samples"])
        assert 0 < r["min_s"] <= r["median_s"] <= r["max_s"]
        assert r["min_s"] == min(r["samples"]) and r["max_s"] == max(r["samples"])
        assert r["ratio"] == pytest.approx(r["median_s"] / base, rel=1e-12)
        assert r["tokens_per_s"] == pytest.approx(8 * 32 / r["median_s"], rel=1e-12)
        assert r["compile_s"] > 0
    table = format_table(report).splitlines()
    assert len(table) == 3 + len(rows) and "d2t4/tp" in table[-1]
    assert len({len(line) for line in table[1:3]}) == 1  # header and rule aligned


def test_timed_steps_train_the_same_model_on_the_same_data(bench):
    cfg, variants, first_batch, before, _ = bench
    np.testing.assert_array_equal(first_batch[0], first_batch[1])
    for v, old in zip(variants, before, strict=True):
        assert v.steps_done == cfg.total_steps
        assert int(jax.device_get(v.state["step"])) == cfg.total_steps
        new = jax.device_get(v.state["params"])
        changed = jax.tree.leaves(jax.tree.map(lambda a, b: not np.array_equal(a, b), old, new))
        assert all(changed), "a parameter did not move during the timed steps"


def run_bench_cli(*args, timeout=240):
    return run_script("bench.py", *args, timeout=timeout)


@pytest.mark.slow
def test_cli_writes_json(tmp_path):
    out = tmp_path / "sub" / "bench.json"
    proc = run_bench_cli(
        *("--model", "tiny", "--batch-size", "8", "--seq-len", "32", "--warmup", "1"),
        *("--rounds", "2", "--steps-per-round", "1", "--schedules", "megatron"),
        *("--mesh", "data=8", "--rules", "dp", "--data", DATA, "--json", str(out)),
        *("--predict", "datasheet"),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["prediction"]["cost_source"] == "datasheet"
    assert report["prediction"]["spearman"] is None  # one variant: nothing to correlate
    assert report["variants"][0]["predicted_s"] > 0 and "planner (datasheet costs" in proc.stdout
    assert "bench.py" in report["command"] and "--json" in report["command"]
    (row,) = report["variants"]
    assert (row["mesh"], row["rules"], row["ratio"], len(row["samples"])) == (
        "data=8",
        "dp",
        1.0,
        2,
    )
    assert row["label"] in proc.stdout and "tokens/s" in proc.stdout
    assert [p.name for p in out.parent.iterdir()] == ["bench.json"]  # no temp file left


def test_cli_bad_variant_is_one_line():
    proc = run_bench_cli("--model", "tiny", "--variant", "data=2,tensor=4/tp/megatron/extra")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1 and lines[0].startswith("bench.py: error: variant"), proc.stderr
