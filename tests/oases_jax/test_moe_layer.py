"""The MoE schedules (ds_moe, parm_s1, parm_s2) on 8 CPU devices against the plain one-device
reference of tests/moe_reference.py: outputs, router losses and every gradient with ample
capacity; kept tokens, routing and outputs with drops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oases_jax.errors import UserError
from oases_jax.mesh import make_mesh
from oases_jax.moe import MoEArgs, MoESetup, moe_layer, routing, use_moe
from oases_jax.rules import get_rules
from tests.moe_reference import moe_reference

E, D, F, B, L, K = 8, 16, 32, 4, 8, 2
MESHES = ("expert=2,tensor=4", "expert=4,tensor=2", "data=2,expert=2,tensor=2")
SCHEDULES = ("ds_moe", "parm_s1", "parm_s2")
AMPLE, TIGHT = E / K, 1.0  # capacity factors: nothing drops (C = T) / about a third drops
NAMES = {"w_in": ("expert", "embed", "mlp"), "b_in": ("expert", "mlp"),
         "w_out": ("expert", "mlp", "embed")}


def _inputs():
    ks = jax.random.split(jax.random.key(0), 6)
    w = {"w_in": 0.3 * jax.random.normal(ks[0], (E, D, F)),
         "b_in": 0.1 * jax.random.normal(ks[1], (E, F)),
         "w_out": 0.3 * jax.random.normal(ks[2], (E, F, D))}
    return (jax.random.normal(ks[5], (B, L, D)), jax.random.normal(ks[4], (D, E)), w,
            0.1 * jax.random.normal(ks[3], (E, D)))


def expert_fn(w, buf):
    h = jax.nn.gelu(jnp.einsum("end,edf->enf", buf, w["w_in"]) + w["b_in"][:, None],
                    approximate=True)
    return jnp.einsum("enf,efd->end", h, w["w_out"])


def _objective(y, aux):
    # Weights every output element and both router losses differently, so every gradient path
    # (experts, gates, router through the aux and z losses) carries signal.
    wts = jnp.cos(jnp.arange(y.size, dtype=jnp.float32)).reshape(y.shape)
    return jnp.sum(y * wts) + 0.3 * aux["aux_loss"] + 0.1 * aux["z_loss"]


def _sharded(mesh_text, schedule, factor, chunks=2, rules="tp", backward_chunks=0):
    mesh, args = make_mesh(mesh_text), MoEArgs(top_k=K, capacity_factor=factor)
    setup = MoESetup(schedule=schedule, chunks=chunks, backward_chunks=backward_chunks)

    def f(x, router, w, b_out):
        with use_moe(setup, get_rules(rules), mesh):
            y, aux = moe_layer(x, router, w, expert_fn=expert_fn, bias_ED=b_out, names=NAMES,
                               args=args, with_routing=True)
        return _objective(y, aux), (y, aux)

    with jax.set_mesh(mesh):
        (_, (y, aux)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3),
                                                          has_aux=True))(*_inputs())
    return y, aux, grads


def _layout(mesh_text, schedule):
    """Token groups of a schedule on a mesh: batch blocks over data x expert, and under the
    de-duplicating schedules sequence blocks over tensor."""
    sizes = dict(make_mesh(mesh_text).shape)
    nb = sizes.get("data", 1) * sizes.get("expert", 1)
    mp = sizes.get("tensor", 1)
    return nb, (1 if schedule == "ds_moe" else mp), mp


def _reference(mesh_text, schedule, factor):
    nb, lm, mp = _layout(mesh_text, schedule)
    t = B * L // (nb * lm)
    c = routing.capacity(t, E, K, factor, mp if schedule == "ds_moe" else 1)

    def group(a):
        return a.reshape(nb, B // nb, lm, L // lm, -1).transpose(0, 2, 1, 3, 4).reshape(
            nb * lm, t, -1)

    def ungroup(a):
        return a.reshape(nb, lm, B // nb, L // lm, -1).transpose(0, 2, 1, 3, 4).reshape(B, L, -1)

    def f(x, router, w, b_out):
        out, losses, r = moe_reference(group(x), router, {**w, "b_out": b_out}, top_k=K,
                                       capacity=c, norm_topk=False, gated=False)
        y = ungroup(out)
        return _objective(y, losses), (y, losses, {k: ungroup(v) for k, v in r.items()})

    (_, (y, aux, r)), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3),
                                                         has_aux=True))(*_inputs())
    return y, {**aux, **r}, grads


def _close(a, b, rel=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.max(np.abs(b))), 1e-30)
    assert float(np.max(np.abs(a - b))) <= rel * scale, (float(np.max(np.abs(a - b))), scale)


@pytest.fixture(scope="module", params=MESHES)
def runs(request):
    """Every schedule at ample and tight capacity on one mesh, with its reference."""
    out = {}
    for schedule in SCHEDULES:
        for factor in (AMPLE, TIGHT):
            out[schedule, factor] = (_sharded(request.param, schedule, factor),
                                     _reference(request.param, schedule, factor))
    return request.param, out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_no_drops_equals_reference(runs, schedule):
    _, out = runs
    (y, aux, grads), (y_ref, aux_ref, grads_ref) = out[schedule, AMPLE]
    assert float(aux["dropped_frac"]) == 0.0 and float(aux_ref["dropped_frac"]) == 0.0
    _close(y, y_ref)
    for k in ("aux_loss", "z_loss"):
        _close(aux[k], aux_ref[k])
    for name, g, g_ref in zip(("x", "router", "experts", "b_out"), grads, grads_ref, strict=True):
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
            assert np.any(np.asarray(b) != 0), name
            _close(a, b)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_routing_equals_single_device_routing(runs, schedule):
    _, out = runs
    for factor in (AMPLE, TIGHT):
        (_, aux, _), (_, ref, _) = out[schedule, factor]
        np.testing.assert_array_equal(aux["expert"], ref["expert"])


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_drops_equal_reference_of_the_same_groups(runs, schedule):
    _, out = runs
    (y, aux, grads), (y_ref, ref, grads_ref) = out[schedule, TIGHT]
    assert 0.1 < float(aux["dropped_frac"]) < 0.6
    np.testing.assert_array_equal(aux["kept"], ref["kept"])
    _close(aux["dropped_frac"], ref["dropped_frac"])
    _close(y, y_ref)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        _close(a, b)


def test_s1_and_s2_keep_the_same_tokens_and_ds_moe_others(runs):
    _, out = runs
    (y1, a1, _), _ = out["parm_s1", TIGHT]
    (y2, a2, _), _ = out["parm_s2", TIGHT]
    (_, a0, _), _ = out["ds_moe", TIGHT]
    np.testing.assert_array_equal(a1["kept"], a2["kept"])
    _close(y2, y1, 1e-6)
    # ds_moe's capacity comes from the duplicated tokens of a whole MP group: another drop set.
    assert np.any(np.asarray(a0["kept"]) != np.asarray(a1["kept"]))


def test_router_losses_equal_across_meshes(runs):
    mesh_text, out = runs
    _, (_, aux_ref, _) = out["parm_s1", AMPLE]
    for schedule in SCHEDULES:
        (_, aux, _), _ = out[schedule, AMPLE]
        for k in ("aux_loss", "z_loss"):  # the one-device value, whatever the mesh
            _close(aux[k], aux_ref[k], 1e-6)


@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_s2_chunk_counts_agree(chunks):
    # 3 does not divide the capacity: S2 pads its buffer, and keeps S1's drop set.
    (y1, a1, g1) = _sharded("expert=2,tensor=4", "parm_s1", TIGHT * 3)
    (y2, a2, g2) = _sharded("expert=2,tensor=4", "parm_s2", TIGHT * 3, chunks=chunks)
    np.testing.assert_array_equal(a1["kept"], a2["kept"])
    _close(y2, y1, 1e-6)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g1), strict=True):
        _close(a, b, 1e-6)


@pytest.mark.parametrize("chunks, backward_chunks, factor",
                         [(2, 4, AMPLE), (4, 1, TIGHT), (3, 2, TIGHT)])
def test_s2_forward_and_backward_chunk_counts_differ(chunks, backward_chunks, factor):
    # The backward's collectives run over their own chunks (hand-written transposes that re-cut
    # the buffers); (3, 2) pads the capacity to a multiple of 6. Outputs and every gradient equal
    # the one-device reference of the same token groups, and the kept tokens are S1's.
    mesh_text = "expert=2,tensor=4"
    y, aux, grads = _sharded(mesh_text, "parm_s2", factor, chunks=chunks,
                             backward_chunks=backward_chunks)
    y_ref, ref, grads_ref = _reference(mesh_text, "parm_s2", factor)
    np.testing.assert_array_equal(aux["kept"], ref["kept"])
    _close(y, y_ref)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref), strict=True):
        assert np.any(np.asarray(b) != 0)
        _close(a, b)


def test_tensor_sequence_parallel_rules_give_the_same_layer():
    # Under tp_sp the residual stream arrives split over tensor already (S1's reduce-scatter
    # variant); the layer is the same function.
    y, aux, g = _sharded("data=2,expert=2,tensor=2", "parm_s1", AMPLE, rules="tp_sp")
    y_ref, aux_ref, g_ref = _reference("data=2,expert=2,tensor=2", "parm_s1", AMPLE)
    _close(y, y_ref)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref), strict=True):
        _close(a, b)


@pytest.mark.parametrize("mesh_text, schedule, match", [
    ("data=2,tensor=4", "parm_s1", "needs an expert mesh axis"),
    ("expert=8", "parm_s1", "does not split over mesh axis expert=8"),
])
def test_bad_setups_are_one_line(mesh_text, schedule, match):
    if "expert=8" in mesh_text:
        with pytest.raises(UserError, match=match) as e:
            _sharded_experts(mesh_text, schedule, n_experts=12)
    else:
        with pytest.raises(UserError, match=match) as e:
            _sharded(mesh_text, schedule, AMPLE)
    assert "\n" not in str(e.value)


def _sharded_experts(mesh_text, schedule, n_experts):
    mesh = make_mesh(mesh_text)
    x = jnp.ones((8, 4, D))
    w = {"w_in": jnp.ones((n_experts, D, F)), "b_in": jnp.ones((n_experts, F)),
         "w_out": jnp.ones((n_experts, F, D))}
    with jax.set_mesh(mesh), use_moe(MoESetup(schedule=schedule), get_rules("tp"), mesh):
        return moe_layer(x, jnp.ones((D, n_experts)), w, expert_fn=expert_fn, bias_ED=None,
                         names=NAMES, args=MoEArgs(top_k=2, capacity_factor=1.0))


def test_capacity_rounding():
    assert routing.capacity(80, 8, 2, 1.1) == 22  # 1.1 * 2 * 80 / 8 = 22.000000000000004
    assert routing.capacity(4, 8, 2, 0.01) == 1  # at least one slot
    assert routing.capacity(4, 8, 2, 100.0) == 4  # at most the group's tokens
    assert routing.capacity(10, 8, 2, 1.0, multiple=4) == 4
