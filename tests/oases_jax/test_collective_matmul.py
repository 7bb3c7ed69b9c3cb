"""Collective-matmul rings against plain jnp references: values and gradients, several meshes,
both ring directions; and their overlap in the compiled GPU program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.collective_matmul import (
    all_gather_matmul,
    all_gather_matmul_reference,
    matmul_reduce_scatter,
    matmul_reduce_scatter_reference,
)
from oases_jax.mesh import make_mesh
from oases_jax.targets import get_target, has_gpu_aot
from oases_jax.tools.analysis.program import analyze

MESHES = ["data=1,tensor=8", "data=2,tensor=4", "data=4,tensor=2"]
B, L, D, F = 4, 32, 16, 24


def _fns(mesh, bidirectional):
    ag = jax.shard_map(
        lambda x, w: all_gather_matmul(x, w, "tensor", bidirectional), mesh=mesh,
        in_specs=(P("data", "tensor", None), P(None, "tensor")),
        out_specs=P("data", None, "tensor"))
    rs = jax.shard_map(
        lambda h, w: matmul_reduce_scatter(h, w, "tensor", bidirectional), mesh=mesh,
        in_specs=(P("data", None, "tensor"), P("tensor", None)),
        out_specs=P("data", "tensor", None))
    return ag, rs


def _data():
    k = jax.random.split(jax.random.key(0), 6)
    return (jax.random.normal(k[0], (B, L, D)), jax.random.normal(k[1], (D, F)),
            jax.random.normal(k[2], (B, L, F)), jax.random.normal(k[3], (F, D)),
            jax.random.normal(k[4], (B, L, F)), jax.random.normal(k[5], (B, L, D)))


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("mesh_spec", MESHES)
def test_values_and_gradients_match_reference(mesh_spec, bidirectional):
    mesh = make_mesh(mesh_spec)
    ag, rs = _fns(mesh, bidirectional)
    x, w1, h, w2, ct1, ct2 = _data()
    np.testing.assert_allclose(jax.jit(ag)(x, w1), all_gather_matmul_reference(x, w1),
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(rs)(h, w2), matmul_reduce_scatter_reference(h, w2),
                               rtol=1e-5, atol=1e-5)

    def grads(f, a, b, ct):
        return jax.jit(jax.grad(lambda a, b: jnp.sum(f(a, b) * ct), argnums=(0, 1)))(a, b)

    for got, want in zip(grads(ag, x, w1, ct1), grads(all_gather_matmul_reference, x, w1, ct1),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads(rs, h, w2, ct2), grads(matmul_reduce_scatter_reference, h, w2, ct2),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_output_shardings():
    mesh = make_mesh("data=2,tensor=4")
    ag, rs = _fns(mesh, False)
    x, w1, h, w2, *_ = _data()
    y, z = jax.jit(ag)(x, w1), jax.jit(rs)(h, w2)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh, P("data", None, "tensor")), 3)
    assert z.sharding.is_equivalent_to(NamedSharding(mesh, P("data", "tensor", None)), 3)


def test_bidirectional_needs_even_blocks():
    mesh = make_mesh("data=1,tensor=8")
    ag, _ = _fns(mesh, True)
    with pytest.raises(ValueError, match="even block"):
        jax.jit(ag)(jnp.ones((1, 8, 4)), jnp.ones((4, 8)))  # one row per device


@pytest.mark.gpu_aot
@pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
@pytest.mark.parametrize("bidirectional", [False, True])
def test_rings_overlap_gemms_on_h100(bidirectional):
    """An MLP (all-gather matmul, GELU, matmul reduce-scatter) forward and backward, compiled for
    8 H100s: the permutes are asynchronous with GEMMs inside their windows."""
    devices = np.asarray(get_target("h100:8").devices, dtype=object).reshape(1, 8)
    mesh = Mesh(devices, ("data", "tensor"))
    ag, rs = _fns(mesh, bidirectional)

    def loss(x, w1, w2):
        return jnp.sum(rs(jax.nn.gelu(ag(x, w1)), w2).astype(jnp.float32))

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, spec))

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(
        arg((8, 1024, 1024), P("data", "tensor", None)), arg((1024, 4096), P(None, "tensor")),
        arg((4096, 1024), P("tensor", None)),
    ).compile(compiler_options={"xla_gpu_enable_latency_hiding_scheduler": True,
                                "xla_gpu_experimental_parallel_collective_overlap_limit": 2})
    analysis = analyze(compiled, mesh)[0]
    assert set(analysis.counts_by_kind()) <= {"collective-permute", "all-reduce"}
    assert analysis.overlap_share(require="gemm", kinds=["collective-permute"]) >= 0.85
