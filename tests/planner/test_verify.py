"""Verifying plans (`planner.verification.verify`): the compile target of each cluster, the compiled
figures beside each prediction (checked against the same plans compiled directly by
`tools.inspection.inspect_program`), and the fit check that marks a plan and never chooses it."""

import dataclasses
import types

import pytest

from oases_jax.errors import UserError
from oases_jax.hardware import ClusterSpec, get_cluster
from oases_jax.models.presets import get_preset
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.search.dense import search
from oases_jax.planner.verification import verify as ver
from oases_jax.targets import get_target, has_gpu_aot
from oases_jax.training.config import ParallelConfig
from oases_jax.training.program import CompileSpec


def _own_device(base: str, name: str, memory_bytes: float, n: int) -> ClusterSpec:
    """A cluster JSON's own device: `base`'s numbers with another memory size."""
    cluster = get_cluster(f"{base}:{n}")
    spec = {**dataclasses.asdict(cluster.device_spec), "name": name,
            "memory_bytes": memory_bytes}
    return ClusterSpec.from_json({**cluster.to_json(), "name": name, "device": name,
                                  "device_spec": spec})


@pytest.mark.parametrize("cluster, target", [
    ("cpu-8", "local"), ("h100-8", "h100:8"), ("h100-32", "h100:32"), ("h200-8", "h200:8"),
    ("a100:16", "a100:16"), ("3090-pcie-32", "3090:32"), ("3090-nvlink-32", "3090:32"),
])
def test_compile_target_of_each_cluster(cluster, target):
    assert ver.compile_target(get_cluster(cluster)) == target


def test_own_device_compiles_as_the_gpu_its_match_names():
    assert ver.compile_target(_own_device("h100", "h100-40g", 40 * 2**30, 8)) == "h100:8"


@pytest.mark.parametrize("cluster, fix", [("v100-32", "--cluster h100:32")])
def test_cluster_without_compile_target_is_one_line_naming_the_fix(cluster, fix):
    with pytest.raises(UserError, match="has no compile target") as e:
        ver.compile_target(get_cluster(cluster))
    assert fix in str(e.value) and "drop --verify" in str(e.value) and "\n" not in str(e.value)


def _reference(c, cfg, target):
    """The candidate compiled directly: its CompileSpec built from the layout and strategies,
    not through the plan JSON `planner.verification.verify` goes through."""
    from oases_jax.tools.inspection import inspect_program

    par = ParallelConfig(mesh=",".join(f"{k}={v}" for k, v in c.layout.mesh().items()),
                         rules=c.layout.rules(), layers=tuple(c.strategies))
    spec = CompileSpec(model=cfg, parallel=par, batch_size=c.layout.global_batch,
                       seq_len=c.layout.seq_len, microbatches=c.layout.microbatches)
    return inspect_program(spec, target).report()


def _tiny_cpu8():
    cfg, cluster = get_preset("tiny"), get_cluster("cpu-8")
    result = search(cfg, Hardware.of(cluster), global_batch=8, seq_len=32)
    return cfg, cluster, result


@pytest.mark.slow
def test_verified_figures_are_the_compiled_programs():
    """The top two tiny plans on cpu-8 (8 CPU devices): each figure is the same plan's
    directly compiled report; the chosen one fits and has the fastest simulated step."""
    cfg, cluster, result = _tiny_cpu8()
    verified = ver.verify(result, cfg, cluster, 2)
    assert [v.candidate for v in verified if not v.baseline] == result.ranked[:2]
    assert all(v.candidate == ver.fsdp_baseline(result)[1] for v in verified if v.baseline)
    for v in verified:
        ref = _reference(v.candidate, cfg, get_target("local"))
        assert v.error is None and v.xla_step_s is None  # XLA's estimate: GPU targets only
        assert v.compiled_peak_memory_bytes == ref["peak_memory_bytes"] > 0
        assert v.simulated_step_s == pytest.approx(ref["simulated_step_s"], rel=1e-9)
        assert v.gemm_overlap_share == ref["gemm_overlap_share"]
        assert v.fits  # a tiny model in 24 GiB
    chosen = ver.choose(verified)
    assert chosen.simulated_step_s == min(v.simulated_step_s for v in verified)
    block = ver.verified_json(verified, chosen, "local")
    assert block["chosen"] == chosen.rank and block["chosen_by"] == "simulated_step_s"
    assert [d["label"] for d in block["candidates"] if not d["baseline"]] == [
        c.summary() for c in result.ranked[:2]]
    assert block["candidates"][0]["predicted_step_s"] == result.ranked[0].cost.step_s


def _fake(cfg, cluster, result, peaks_steps, errors=()):
    """Verified records with given compiled peaks and simulated steps (no compile)."""
    mem = cluster.device_spec.memory_bytes
    return [ver.Verified(candidate=c, rank=i + 1, device_memory_bytes=mem,
                         compiled_peak_memory_bytes=None if i in errors else peak,
                         simulated_step_s=None if i in errors else step,
                         error="XLA aborted the compile: x" if i in errors else None)
            for i, (c, (peak, step)) in enumerate(zip(result.ranked, peaks_steps, strict=False))]


def test_a_plan_that_does_not_fit_is_never_chosen(monkeypatch):
    cfg, cluster, result = _tiny_cpu8()
    gib = 2**30
    # 24 GiB devices: rank 1 is the fastest simulated but peaks at 30 GiB; rank 3 failed.
    verified = _fake(cfg, cluster, result, [(30 * gib, 1.0), (20 * gib, 3.0), (1 * gib, 0.5),
                                            (10 * gib, 2.0)], errors={2})
    assert [v.fits for v in verified] == [False, True, False, True]
    assert ver.choose(verified).rank == 4  # fastest simulated among those that fit
    monkeypatch.setattr(ver, "verify", lambda *a, **k: verified)
    lines = []
    plan, _, chosen = ver.verify_plan(result, cfg, cluster, 4, model="tiny",
                                      cost_source="datasheet", log=lines.append)
    assert chosen.rank == 4 and plan["mesh"] == result.ranked[3].layout.mesh()
    assert plan["layers"] == [s.to_json() for s in result.ranked[3].strategies]
    assert plan["predicted_step_s"] == result.ranked[3].cost.step_s
    assert all(a["summary"] != result.ranked[3].summary() for a in plan["alternatives"])
    assert [c["fits"] for c in plan["verified"]["candidates"]] == [False, True, False, True]
    rows = [r for r in lines[-1].splitlines()[1:] if not r.startswith("     ")]
    assert [r.split()[-1] for r in rows] == ["NO", "yes", "FAILED", "chosen"]
    assert "XLA aborted the compile: x" in lines[-1]


def test_none_fits_is_one_line_naming_the_fix(monkeypatch):
    cfg, cluster, result = _tiny_cpu8()
    gib = 2**30
    verified = _fake(cfg, cluster, result, [(30 * gib, 1.0), (25 * gib, 2.0)])
    assert ver.choose(verified) is None
    monkeypatch.setattr(ver, "verify", lambda *a, **k: verified)
    with pytest.raises(UserError) as e:
        ver.verify_plan(result, cfg, cluster, 2, model="tiny", cost_source="datasheet",
                        log=lambda s: None)
    msg = str(e.value)
    # The 8 CPU devices share the host's memory: each has an eighth of it.
    each = cluster.device_spec.memory_bytes / 8
    assert cluster.memory_per_device == each
    assert f"none of the top 2 plans fits {each / gib:.1f} GiB per device" in msg
    assert "25.0 GiB" in msg
    assert "--verify 4" in msg and "--global-batch" in msg and "--cluster" in msg
    assert "\n" not in msg


@pytest.mark.slow
@pytest.mark.gpu_aot
@pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
def test_h100_fit_check_marks_the_plan_whose_compiled_peak_exceeds_memory():
    """`small` on h100-8: the top two plans compiled directly for h100:8; on H100s whose memory
    lies between their compiled peaks, the larger one is marked and the other chosen, with
    every figure (XLA's estimate included) that of the direct compile."""
    cfg, cluster = get_preset("small"), get_cluster("h100-8")
    result = search(cfg, Hardware.of(cluster), global_batch=8, seq_len=256)
    top = result.ranked[:2]
    refs = [_reference(c, cfg, get_target("h100:8")) for c in top]
    peaks = [r["peak_memory_bytes"] for r in refs]
    assert peaks[0] != peaks[1], peaks
    small = _own_device("h100", "h100-verify-test", (peaks[0] + peaks[1]) / 2, 8)
    lines = []
    plan, verified, chosen = ver.verify_plan(result, cfg, small, 2, model="small",
                                             cost_source="datasheet", log=lines.append,
                                             baseline=False)
    big = max(range(2), key=lambda i: peaks[i])
    assert [v.fits for v in verified] == [i != big for i in range(2)]
    assert chosen.rank == 2 - big and plan["mesh"] == top[1 - big].layout.mesh()
    for v, r in zip(verified, refs, strict=True):
        assert v.compiled_peak_memory_bytes == r["peak_memory_bytes"]
        assert v.simulated_step_s == pytest.approx(r["simulated_step_s"], rel=1e-9)
        assert v.xla_step_s == pytest.approx(r["xla_estimate"]["step_s"], rel=1e-9)
        assert v.gemm_overlap_share == r["gemm_overlap_share"]
    assert plan["verified"]["target"] == "h100:8"
    assert plan["verified"]["candidates"][big]["fits"] is False
    assert "NO" in lines[-1].splitlines()[1 + big]


def test_a_compile_that_fails_is_recorded_and_never_fits(monkeypatch):
    import oases_jax.tools.inspection

    def fail(spec, target):
        raise ValueError("Size of label 'd' does not match\nmore detail")

    monkeypatch.setattr(oases_jax.tools.inspection, "inspect_program", fail)
    cfg, cluster, result = _tiny_cpu8()
    v = ver.verify_one(result.ranked[0], 1, cfg, ver.target_for(cluster))
    assert v.error == "compile failed: ValueError: Size of label 'd' does not match"
    assert not v.fits and v.compiled_peak_memory_bytes is None
    assert ver.choose([v]) is None


def test_the_fsdp_only_baseline_is_verified_beside_the_top_plans(monkeypatch):
    """`verify` compiles the best plan that only shards over every device (no tensor axis)
    after the top N when it is not among them, marked as the baseline, and it can be chosen."""
    cfg = get_preset("llama2-7b").with_overrides(["dtype=bfloat16"])
    cluster = get_cluster("h100-8")
    result = search(cfg, Hardware.of(cluster), global_batch=8, seq_len=2048)
    rank, base = ver.fsdp_baseline(result)
    lay = base.layout
    assert (lay.tensor, lay.fsdp, lay.data, lay.primepar) == (1, 8, 1, False)
    assert all(c.layout.tensor > 1 or c.layout.fsdp == 1 for c in result.ranked[:rank - 1])
    n = min(2, rank - 1)
    seen = []

    def fake(c, r, cfg_, target):
        seen.append((r, c.summary()))
        return ver.Verified(candidate=c, rank=r, device_memory_bytes=80 * 2**30,
                            compiled_peak_memory_bytes=2**30, simulated_step_s=1.0 / r)

    monkeypatch.setattr(ver, "verify_one", fake)
    # The compiles are faked, so no GPU compile target (the gpu-aot extra) is needed.
    monkeypatch.setattr(ver, "target_for", lambda cluster: types.SimpleNamespace(name="h100:8"))
    verified = ver.verify(result, cfg, cluster, n)
    assert seen == [(i, c.summary()) for i, c in enumerate(result.ranked[:n], 1)] + [
        (rank, base.summary())]
    assert [v.baseline for v in verified] == [None] * n + ["fsdp"]
    assert ver.choose(verified).baseline == "fsdp"  # the fastest simulated: it is chosen
    assert "(FSDP-only baseline)" in ver.table(verified, ver.choose(verified))


def test_scheduler_limit_by_hand():
    """XLA's GPU scheduling limit in peak terms: io + (0.8 M - io) x 0.95 with io the
    non-aliased inputs and outputs; the planner's default budget on GPUs is 0.76 M, on CPUs
    0.9 M, and a given --memory-fraction wins."""
    gib = 2**30
    mem = {"argument": 30 * gib, "output": 30 * gib, "alias": 28 * gib, "temp": 40 * gib}
    io = 32 * gib
    assert ver.scheduler_limit_bytes(mem, 80 * gib) == pytest.approx(io + (64 * gib - io) * 0.95)
    h100, cpu = Hardware.of(get_cluster("h100-8")), Hardware.of(get_cluster("cpu-8"))
    assert h100.memory_budget() == pytest.approx(0.76 * h100.cluster.device_spec.memory_bytes)
    assert cpu.memory_budget() == pytest.approx(0.9 * cpu.cluster.device_spec.memory_bytes / 8)
    assert h100.memory_budget(0.5) == pytest.approx(0.5 * h100.cluster.device_spec.memory_bytes)
    v = ver.Verified(candidate=None, rank=1, device_memory_bytes=80 * gib,
                     compiled_peak_memory_bytes=70 * gib,
                     scheduler_limit_bytes=ver.scheduler_limit_bytes(mem, 80 * gib))
    assert v.fits and v.over_scheduler_limit
