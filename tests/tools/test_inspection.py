"""tools/inspection.py without compiling: GPU options of mixed plans, specs through JSON."""

from models.presets import get_preset
from oases_jax.analysis.hardware import get_cluster
from oases_jax.analysis.targets import Target
from oases_jax.layer_plan import LayerSpec
from tools.inspection import (
    GPU_OPTIONS,
    CompileSpec,
    compiler_options,
    spec_from_json,
    spec_to_json,
)
from training.config import ParallelConfig

GPU = Target("h100:8", (), get_cluster("h100:8"), is_gpu_aot=True)


def test_mixed_schedules_get_the_union_of_their_gpu_options():
    opts = compiler_options(("megatron", "collective_matmul", "oases", "primepar"), GPU)
    assert opts == {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_experimental_parallel_collective_overlap_limit": 3,  # primepar's, not 2
        "xla_gpu_all_reduce_combine_threshold_bytes": 0,
        "xla_gpu_all_gather_combine_threshold_bytes": 0,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
        "xla_gpu_collective_permute_combine_threshold_bytes": 0,
        "xla_disable_hlo_passes": "dot-merger",
    }
    assert compiler_options("oases", GPU) == GPU_OPTIONS["oases"]
    local = Target("local", (), get_cluster("cpu-8"), is_gpu_aot=False)
    assert compiler_options(("oases", "collective_matmul"), local) == {}


def test_disabled_passes_are_joined(monkeypatch):
    monkeypatch.setitem(GPU_OPTIONS, "extra",
                        {"xla_disable_hlo_passes": "all-gather-combiner,dot-merger"})
    opts = compiler_options(("oases", "extra"), GPU)
    assert opts["xla_disable_hlo_passes"] == "dot-merger,all-gather-combiner"


def test_a_plan_spec_survives_json():
    layers = (LayerSpec(schedule="oases_cm", sub_batches=2, remat="save_proj"),
              LayerSpec(schedule="megatron"))
    spec = CompileSpec(model=get_preset("tiny"), batch_size=16, seq_len=64, microbatches=2,
                       parallel=ParallelConfig(mesh="data=2,tensor=4", layers=layers))
    assert spec_from_json(spec_to_json(spec)) == spec
    assert spec.parallel.schedules == ("oases_cm", "megatron")



def test_report_gives_each_kinds_gemm_share():
    """Each kind's bytes-weighted GEMM-in-window share, by hand: of 5 MiB of permutes (1 MiB
    twice and 2 MiB once with a GEMM, 1 MiB once without) 4 are hidden; no all-reduce is."""
    from oases_jax.analysis.program import Analysis, Collective
    from tools.report import by_kind_line

    mib = 2**20
    rows = [("collective-permute", mib, 2, 1), ("collective-permute", 2 * mib, 1, 1),
            ("collective-permute", mib, 1, 0), ("all-reduce", mib // 2, 4, 0)]
    collectives = [
        Collective(name=f"c{i}", computation="main", kind=kind, bytes=nbytes, group_size=2,
                   groups=[], axes=("tensor",), is_async=True, count=count, window_gemms=gemms,
                   window_compute=1)
        for i, (kind, nbytes, count, gemms) in enumerate(rows)]
    analysis = Analysis(collectives=collectives, flops=0.0, memory={}, op_counts={})
    shares = {k: analysis.overlap_share(require="gemm", kinds=[k])
              for k in sorted(analysis.counts_by_kind())}
    assert shares == {"all-reduce": 0.0, "collective-permute": 0.8}
    assert by_kind_line({"gemm_overlap_share_by_kind": shares}) == [
        "  with a GEMM in window, by kind: all-reduce 0.000, collective-permute 0.800"]
    assert by_kind_line({"gemm_overlap_share_by_kind": {"all-reduce": 1.0}}) == []
