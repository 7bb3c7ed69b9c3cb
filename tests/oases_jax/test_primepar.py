"""PrimePar projections against plain jnp references: values, input and weight gradients on
several layouts of the square, the weight layouts, q = 4 in a child process, and the compiled
program (permutes only; on the GPU target, each with a GEMM in its window)."""

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax import primepar
from oases_jax.errors import UserError
from oases_jax.mesh import make_mesh
from oases_jax.targets import get_target, has_gpu_aot
from oases_jax.tools.analysis.program import analyze

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# 8 devices: the 2x2 square beside data=2, with the data axis outside, inside and between.
MESHES = ["data=2,tp_row=2,tp_col=2", "tp_row=2,tp_col=2,data=2", "tp_row=2,data=2,tp_col=2"]
B, L, D, F = 8, 8, 16, 24
X_SPEC = P(("data", "tp_row"), None, "tp_col")  # activations: batch over data x rows
TOL = dict(rtol=1e-5, atol=1e-5)


def _fns(mesh):
    """Column and row projections as global functions in standard layouts: the stored weight
    layouts are applied outside, the skewed activation layout is undone inside."""
    q = mesh.shape["tp_row"]

    def col(x, w):
        f = jax.shard_map(
            lambda x, w: primepar.unskew(primepar.column_matmul(x, w, "tp_row", "tp_col"),
                                         "tp_row", "tp_col"),
            mesh=mesh, in_specs=(X_SPEC, P("tp_row", "tp_col")), out_specs=X_SPEC)
        return f(x, primepar.to_stored(w, "column", q))

    def row(h, w):
        f = jax.shard_map(
            lambda h, w: primepar.row_matmul(primepar.skew(h, "tp_row", "tp_col"), w,
                                             "tp_row", "tp_col"),
            mesh=mesh, in_specs=(X_SPEC, P("tp_col", "tp_row")), out_specs=X_SPEC)
        return f(h, primepar.to_stored(w, "row", q))

    def mlp(x, w1, w2):
        return _mlp_stored(mesh)(x, primepar.to_stored(w1, "column", q),
                                 primepar.to_stored(w2, "row", q))

    return col, row, mlp


def _mlp_stored(mesh):
    """column -> gelu -> row on stored weights: no data movement between the two projections."""
    return jax.shard_map(
        lambda x, w1, w2: primepar.row_matmul(
            jax.nn.gelu(primepar.column_matmul(x, w1, "tp_row", "tp_col")), w2,
            "tp_row", "tp_col"),
        mesh=mesh, in_specs=(X_SPEC, P("tp_row", "tp_col"), P("tp_col", "tp_row")),
        out_specs=X_SPEC)


def _mlp_reference(x, w1, w2):
    return primepar.matmul_reference(jax.nn.gelu(primepar.matmul_reference(x, w1)), w2)


def _data():
    # Weights scaled by 1/sqrt(fan-in), as models initialise them: outputs of order one.
    k = jax.random.split(jax.random.key(0), 6)
    return (jax.random.normal(k[0], (B, L, D)), jax.random.normal(k[1], (D, F)) / D**0.5,
            jax.random.normal(k[2], (B, L, F)), jax.random.normal(k[3], (F, D)) / F**0.5,
            jax.random.normal(k[4], (B, L, F)), jax.random.normal(k[5], (B, L, D)))


def _grads(f, args, ct):
    n = len(args)
    return jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * ct), argnums=tuple(range(n))))(*args)


def _check_all(mesh):
    col, row, mlp = _fns(mesh)
    ref = primepar.matmul_reference
    x, w1, h, w2, ct1, ct2 = _data()
    cases = [(col, ref, (x, w1), ct1), (row, ref, (h, w2), ct2),
             (mlp, _mlp_reference, (x, w1, w2), ct2)]
    for f, f_ref, args, ct in cases:
        np.testing.assert_allclose(jax.jit(f)(*args), f_ref(*args), **TOL)
        for got, want in zip(_grads(f, args, ct), _grads(f_ref, args, ct), strict=True):
            np.testing.assert_allclose(got, want, **TOL)


@pytest.mark.parametrize("mesh_spec", MESHES)
def test_values_and_gradients_match_reference(mesh_spec):
    _check_all(make_mesh(mesh_spec))


def test_single_device_square_is_a_plain_matmul():
    _check_all(make_mesh("data=8,tp_row=1,tp_col=1"))


def test_q4_on_16_devices_in_a_child():
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {ROOT!r})
        import jax
        jax.config.update("jax_num_cpu_devices", 16)
        from oases_jax.mesh import make_mesh
        from tests.oases_jax import test_primepar as t
        t._check_all(make_mesh("data=1,tp_row=4,tp_col=4"))
        print("ok")
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.parametrize("q", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", primepar.KINDS)
def test_weight_layouts_round_trip(kind, q):
    w = np.arange(2 * 12 * 5 * 12, dtype=np.float32).reshape(2, 12, 5, 12)  # stacked, 3 dims
    stored = primepar.to_stored(w, kind, q, in_axis=1, out_axis=-1)
    np.testing.assert_array_equal(primepar.to_standard(stored, kind, q, in_axis=1, out_axis=-1), w)
    np.testing.assert_array_equal(
        np.asarray(primepar.to_stored(jnp.asarray(w), kind, q, in_axis=1, out_axis=-1)), stored)
    b = 12 // q
    for p_in in range(q):
        for p_out in range(q):
            c_in, c_out = primepar.source_block(kind, p_in, p_out, q)
            np.testing.assert_array_equal(
                stored[:, p_in * b:(p_in + 1) * b, :, p_out * b:(p_out + 1) * b],
                w[:, c_in * b:(c_in + 1) * b, :, c_out * b:(c_out + 1) * b])


@pytest.mark.parametrize("kind", primepar.KINDS)
def test_sharded_relayout_is_the_block_permutation(kind):
    """One ppermute over the square turns the sharded standard weight into the stored one."""
    mesh = make_mesh("data=2,tp_row=2,tp_col=2")
    spec = P("tp_row", "tp_col") if kind == "column" else P("tp_col", "tp_row")
    w = jax.random.normal(jax.random.key(3), (D, F))
    w = jax.device_put(w, NamedSharding(mesh, spec))

    def relayout(stored):
        pairs = primepar.relayout_pairs(kind, 2, stored=stored)
        return jax.shard_map(lambda a: jax.lax.ppermute(a, ("tp_row", "tp_col"), pairs),
                             mesh=mesh, in_specs=spec, out_specs=spec)

    stored = jax.jit(relayout(True))(w)
    np.testing.assert_array_equal(stored, primepar.to_stored(np.asarray(w), kind, 2))
    np.testing.assert_array_equal(jax.jit(relayout(False))(stored), w)


def test_non_square_is_a_user_error():
    with pytest.raises(UserError, match="square"):
        primepar.square_size({"tp_row": 4, "tp_col": 2}, "tp_row", "tp_col")


def _mlp_program(mesh, shapes, dtype):
    mlp = _mlp_stored(mesh)
    (b, length, d, f) = shapes

    def fwd_bwd(x, w1, w2, ct):  # the gradient of sum(ct * y^2 / 2), without the sum's psum
        y, pullback = jax.vjp(mlp, x, w1, w2)
        return pullback(ct * y)

    def arg(shape, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    return jax.jit(fwd_bwd).lower(
        arg((b, length, d), X_SPEC), arg((d, f), P("tp_row", "tp_col")),
        arg((f, d), P("tp_col", "tp_row")), arg((b, length, d), X_SPEC))


def test_mlp_program_has_permutes_only():
    """Forward and backward of column -> gelu -> row on the square: no all-reduce, all-gather or
    reduce-scatter. 11 (q-1) permutes, 4 forward and 7 backward per q-1; for q = 2 a shift
    by +1 is one by -1, so two backward weight shifts are the forward's (XLA shares them)."""
    devices = jax.devices()[:4]
    mesh = make_mesh("data=1,tp_row=2,tp_col=2", devices)
    compiled = _mlp_program(mesh, (4, 8, 16, 32), jnp.float32).compile()
    counts = _communicating(analyze(compiled, mesh)[0])
    assert counts == {"collective-permute": 9}, counts


def _communicating(analysis) -> dict[str, int]:
    """Collective counts by kind, leaving out those over one device (the weight gradients'
    psum over data=1)."""
    counts = {}
    for c in analysis.collectives:
        if c.kind == "collective-permute" or c.group_size > 1:
            counts[c.kind] = counts.get(c.kind, 0) + c.count
    return counts


@pytest.mark.gpu_aot
@pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
@pytest.mark.parametrize("n, mesh_spec", [(4, "data=1,tp_row=2,tp_col=2"),
                                         (16, "data=1,tp_row=4,tp_col=4")])
def test_mlp_permutes_overlap_gemms_on_h100(n, mesh_spec):
    """The MLP compiled for H100s: every permute is asynchronous with a GEMM in its window."""
    from oases_jax import registry

    mesh = make_mesh(mesh_spec, get_target(f"h100:{n}").devices)
    compiled = _mlp_program(mesh, (8, 1024, 1600, 6400), jnp.bfloat16).compile(
        compiler_options=registry.compiler_options("primepar", "gpu"))
    analysis = analyze(compiled, mesh)[0]
    assert set(_communicating(analysis)) == {"collective-permute"}
    assert analysis.overlap_share(require="gemm", kinds=["collective-permute"]) >= 0.9


def test_primepar_rules_by_hand():
    from oases_jax.rules import get_rules

    mesh, rules = make_mesh("data=2,tp_row=2,tp_col=2"), get_rules("primepar")
    assert rules.param_spec(("embed", "heads", "head_dim"), mesh) == P("tp_row", "tp_col", None)
    assert rules.param_spec(("mlp", "embed"), mesh) == P("tp_col", "tp_row")
    assert rules.param_spec(("norm",), mesh) == P("tp_col")
    assert rules.act_spec(("batch", "seq", "embed"), mesh) == X_SPEC
    assert rules.act_spec(("batch", None, "heads", "head_dim"), mesh) == X_SPEC + (None,)
