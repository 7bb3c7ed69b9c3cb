"""Cost sources of the planner: the XLA profile loads by default for h100-8, prices collectives
as its fit says (hand arithmetic), and scripts/plan.py --compare-sources prints a row per source;
unknown sources and missing profiles are one-line errors."""

import json
import re

import pytest

from oases_jax.errors import UserError
from oases_jax.hardware import get_cluster
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.presets import get_preset
from oases_jax.planner import default_xla_profile, load_profile
from oases_jax.planner.calibration.profile import ROOT
from oases_jax.planner.cost.layer_cost import LayerModel
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout
from tests.scriptrun import run_script

XLA_H100_8 = ROOT / "planner" / "profiles" / "xla-h100-8.json"
MIB = 2**20
ROW = re.compile(r"(?P<model>\S+) +(?P<source>\S+) +(?P<plan>\S.*?) +(?P<ms>[\d.]+) +"
                 r"(?P<exposed>[\d.]+) +(?P<mega>\S.*?) +(?P<mega_ms>[\d.]+) +(?P<speedup>[\d.]+)")


def fit(kind: str, n: int) -> dict:
    """The (kind, n) collective fit as written in planner/profiles/xla-h100-8.json."""
    comm = json.loads(XLA_H100_8.read_text())["comm"]
    return next(c for c in comm if c["kind"] == kind and c["n"] == n)


@pytest.mark.parametrize("cluster", ["h100-8", "h100:8"])
def test_xla_source_loads_by_default_for_h100_8(cluster):
    c = get_cluster(cluster)
    assert default_xla_profile(c) == XLA_H100_8
    prof = load_profile("xla", c)
    assert (prof.source, prof.device, prof.n_devices) == ("xla", "h100", 8)
    assert {n for _, n in prof.comm} == {2, 4, 8}
    assert load_profile("datasheet", c) is None


def test_xla_prices_a_permute_at_its_fit_not_nvlink():
    """8 MiB ring permute over 8 H100s. XLA's fit (profile): latency 20.38 us, 149.67 GB/s ->
    20.38 + 8388608 / 149.67e9 s = 20.38 + 56.05 = 76.43 us (110 GB/s effective). Datasheet
    NVLink 4: 3 us + 8388608 / 450e9 s = 3 + 18.64 = 21.64 us (388 GB/s)."""
    c = get_cluster("h100-8")
    datasheet, xla = Hardware.of(c), Hardware.of(c, load_profile("xla", c))
    f = fit("collective-permute", 8)
    nbytes = 8 * MIB
    assert xla.comm_s("collective-permute", nbytes, range(8)) == pytest.approx(
        f["latency_s"] + nbytes / f["bytes_per_s"], rel=1e-12)
    assert xla.comm_s("collective-permute", nbytes, range(8)) == pytest.approx(76.43e-6, rel=1e-3)
    assert datasheet.comm_s("collective-permute", nbytes, range(8)) == pytest.approx(
        21.64e-6, rel=1e-3)
    # Every kind: latency + bytes / bandwidth of its (kind, n) fit.
    for kind, n in [("all-gather", 4), ("reduce-scatter", 8), ("all-reduce", 2)]:
        f = fit(kind, n)
        assert xla.comm_s(kind, 4 * MIB, range(n)) == pytest.approx(
            f["latency_s"] + 4 * MIB / f["bytes_per_s"], rel=1e-12)


def test_xla_source_prices_ring_schedules_dearer():
    """The ring schedules are built of permutes, which XLA prices 3-6x the datasheet: one
    oases-h4096-l16 layer's collective_matmul communication costs more under xla."""
    cfg = get_preset("oases-h4096-l16")
    c = get_cluster("h100-8")
    layout = Layout(tensor=8, global_batch=8, seq_len=1024)
    s = LayerSpec(schedule="collective_matmul")
    ds = LayerModel(cfg, layout, Hardware.of(c)).time(s)
    xla = LayerModel(cfg, layout, Hardware.of(c, load_profile("xla", c))).time(s)
    assert xla.comm_s > 2 * ds.comm_s
    assert xla.step_s > ds.step_s


@pytest.mark.parametrize("cluster,message", [
    ("h100-32",
     "python scripts/xla_sweep.py --target h100:32 --out planner/profiles/xla-h100-32.json"),
    ("h200-8",
     "python scripts/xla_sweep.py --target h200:8 --out planner/profiles/xla-h200-8.json"),
    ("cpu-8", "use --cost-source datasheet or profile"),
])
def test_missing_xla_profile_names_the_sweep(cluster, message):
    with pytest.raises(UserError, match="--cost-source xla") as e:
        load_profile("xla", get_cluster(cluster))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_profile_of_the_wrong_source_is_refused():
    with pytest.raises(UserError, match="holds 'profile' costs, not 'xla'"):
        load_profile("xla", get_cluster("h100-8"),
                     str(ROOT / "planner" / "profiles" / "cpu-8.json"))


def test_compare_sources_prints_a_row_per_model_and_source():
    r = run_script("plan.py", "--model", "small", "--cluster", "h100-8", "--global-batch", "8",
                   "--top", "1", "--compare", "small,tiny", "--compare-sources",
                   "datasheet,xla", timeout=120)
    assert r.returncode == 0, r.stderr
    rows = [ROW.fullmatch(row) for row in r.stdout[r.stdout.index("model "):].splitlines()[1:]]
    assert all(rows), r.stdout
    assert [m.group("model", "source") for m in rows] == [
        ("small", "datasheet"), ("small", "xla"), ("tiny", "datasheet"), ("tiny", "xla")]
    for m in rows:
        ms, mega_ms, speedup = (float(m[k]) for k in ("ms", "mega_ms", "speedup"))
        assert 0 < ms <= mega_ms and speedup == pytest.approx(mega_ms / ms, abs=0.02)
    # XLA prices every collective and GEMM of the same plan dearer than the datasheet.
    assert float(rows[1]["ms"]) > float(rows[0]["ms"])


@pytest.mark.parametrize("args,message", [
    (["--compare-sources", "datasheet,magic"], "unknown cost source 'magic' in --compare-sources"),
    (["--cluster", "h100-32", "--compare-sources", "datasheet,xla"],
     "xla_sweep.py --target h100:32 --out planner/profiles/xla-h100-32.json"),
])
def test_compare_sources_errors(args, message):
    r = run_script("plan.py", *args, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
