"""Inspection without compiling: compile specs through JSON, the per-kind report line."""

from oases_jax.layer_plan import LayerSpec
from oases_jax.models.presets import get_preset
from oases_jax.training.config import ParallelConfig
from oases_jax.training.program import CompileSpec


def test_a_plan_spec_survives_json():
    layers = (LayerSpec(schedule="oases_cm", sub_batches=2, remat="save_proj"),
              LayerSpec(schedule="megatron"))
    spec = CompileSpec(model=get_preset("tiny"), batch_size=16, seq_len=64, microbatches=2,
                       parallel=ParallelConfig(mesh="data=2,tensor=4", layers=layers))
    assert CompileSpec.from_json(spec.to_json()) == spec
    assert spec.parallel.schedules == ("oases_cm", "megatron")



def test_report_gives_each_kinds_gemm_share():
    """Each kind's bytes-weighted GEMM-in-window share, by hand: of 5 MiB of permutes (1 MiB
    twice and 2 MiB once with a GEMM, 1 MiB once without) 4 are hidden; no all-reduce is."""
    from oases_jax.tools.analysis.program import Analysis, Collective
    from oases_jax.tools.report import by_kind_line

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
