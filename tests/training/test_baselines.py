"""Honest baselines: `megatron_sp` compiles to Megatron-SP's collectives and nothing else."""

import pytest

from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.tools.analysis.program import analyze
from oases_jax.training.config import ParallelConfig
from oases_jax.training.program import CompileSpec, lower

B, L, T = 8, 1024, 8  # batch, sequence, tensor-parallel size
CFG = get_preset("gpt2-1.5b").replace(n_heads=32, head_dim=50)  # d_model 1600, fp32


@pytest.fixture(scope="module")
def h100():
    from oases_jax.targets import get_target, has_gpu_aot

    if not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    return get_target("h100:8")


def _layer(target, remat: str):
    spec = CompileSpec(model=CFG.replace(remat=remat), batch_size=B, seq_len=L, layer=True,
                       parallel=ParallelConfig(mesh=f"tensor={T}", schedule="megatron_sp"))
    mesh = make_mesh(spec.parallel.mesh, target.devices)
    return analyze(lower(spec, mesh).compile(), mesh)[0]


@pytest.mark.gpu_aot
@pytest.mark.parametrize("remat, gathers, scatters", [
    # Forward: all-gather before the QKV and the MLP-in projections, reduce-scatter after the
    # attention-out and MLP-out projections; backward: the mirror of each (the gathers'
    # gradients are reduce-scatters and the other way round).
    ("none", 2 + 2, 2 + 2),
    # Full recomputation runs the forward's two gathers and two scatters again (the layer
    # program's value, sum(y^2)/2, is inside the recomputed function, so y is recomputed too).
    ("full", 2 + 2 + 2, 2 + 2 + 2),
])
def test_megatron_sp_layer_has_only_its_collectives(h100, remat, gathers, scatters):
    a = _layer(h100, remat)
    residual = B * L * CFG.d_model * 4  # one [B, L, D] fp32 residual stream, gathered
    assert set(a.counts_by_kind()) <= {"all-gather", "reduce-scatter", "all-reduce"}
    assert a.collective_bytes(["all-gather"]) == gathers * residual
    assert a.collective_bytes(["reduce-scatter"]) == scatters * residual
    # The only all-reduce: gradients of the parameters every device holds whole while it sees
    # a slice of the sequence (two norms' scales and biases, two output biases), and the
    # program's fp32 scalar value.
    assert a.collective_bytes(["all-reduce"]) == (4 + 2) * CFG.d_model * 4 + 4
    # Attention scores never cross devices: no collective is larger than the residual stream
    # a combiner may pair up.
    assert max(c.bytes for c in a.collectives) <= 2 * residual


@pytest.mark.gpu_aot
def test_xla_auto_compiles_xlas_windowed_einsum_on_gpt2_layer(h100):
    """XLA's own collective matmul on the GPT-2 1.5B layer: the compile (in a child process,
    where an XLA abort becomes an error) succeeds, and the tensor-parallel traffic is permutes
    of XLA's windowed loops: no all-gather, reduce-scatter or all-to-all of the residual."""
    from oases_jax.tools.inspection import inspect_isolated

    spec = CompileSpec(model=CFG, batch_size=B, seq_len=L, layer=True,
                       parallel=ParallelConfig(mesh=f"tensor={T}", schedule="xla_auto"))
    report = inspect_isolated(spec, "h100:8")
    assert "error" not in report, report.get("error")
    counts = report["collective_counts"]
    assert set(counts) == {"collective-permute", "all-reduce"}
    # Only the replicated parameters' gradients and the value are all-reduced, as above.
    assert report["collective_bytes"] - sum(
        c["bytes"] * c["count"] for c in report["collectives"]
        if c["kind"] == "collective-permute") == (4 + 2) * CFG.d_model * 4 + 4
    assert counts["collective-permute"] >= 10 * (T - 1)  # ten loops of seven steps
