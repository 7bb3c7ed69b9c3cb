"""Honest baselines: `megatron_sp` compiles to Megatron-SP's collectives and nothing else."""

import pytest

from models import get_preset
from oases_jax.analysis.program import analyze
from oases_jax.mesh import make_mesh
from training.config import ParallelConfig
from training.program import CompileSpec, lower

B, L, T = 8, 1024, 8  # batch, sequence, tensor-parallel size
CFG = get_preset("gpt2-1.5b").replace(n_heads=32, head_dim=50)  # d_model 1600, fp32


@pytest.fixture(scope="module")
def h100():
    from oases_jax.analysis.targets import get_target, has_gpu_aot

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
    # Full recomputation gathers both inputs again and scatters the attention output again
    # (the MLP's output is the layer's and is not needed by the backward).
    ("full", 2 + 2 + 2, 2 + 1 + 2),
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
