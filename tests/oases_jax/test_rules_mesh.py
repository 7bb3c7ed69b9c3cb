"""Mesh specs (parse, resolve, build) and logical sharding rules (specs, constrain, divisors)."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.errors import UserError
from oases_jax.mesh import MeshSpec, make_mesh, parse_mesh
from oases_jax.rules import (
    LOGICAL_AXES,
    OPTIONAL_AXES,
    RULE_SETS,
    ShardingRules,
    active_rules,
    constrain,
    fsdp,
    get_rules,
    megatron,
    spec_divides,
    use_rules,
)

# ---------------------------------------------------------------------------------------------
# parse_mesh / MeshSpec.resolve


def test_parse_keeps_order_and_sizes():
    spec = parse_mesh("data=2,tensor=4")
    assert spec.axes == (("data", 2), ("tensor", 4))
    assert spec.names == ("data", "tensor")
    assert spec.shape == (2, 4)
    assert parse_mesh("tensor=4,data=2").names == ("tensor", "data")
    assert str(spec) == "data=2,tensor=4"
    assert parse_mesh(str(spec)) == spec


def test_parse_tolerates_spaces_and_size_defaults_to_one():
    spec = parse_mesh(" data = 2 , tensor=4 ")
    assert spec.axes == (("data", 2), ("tensor", 4))
    assert spec.size("tensor") == 4
    assert spec.size("stage") == 1


@pytest.mark.parametrize(
    "text, n, expected",
    [
        ("data=-1,tensor=4", 8, (2, 4)),
        ("data=2,tensor=-1", 8, (2, 4)),
        ("data=-1", 8, (8,)),
        ("stage=2,data=-1,tensor=2", 8, (2, 2, 2)),
        ("data=2,tensor=4", 8, (2, 4)),
    ],
)
def test_resolve_fills_the_one_minus_one(text, n, expected):
    resolved = parse_mesh(text).resolve(n)
    assert resolved.shape == expected
    assert resolved.names == parse_mesh(text).names


@pytest.mark.parametrize(
    "text, n, fragment",
    [
        ("data=2,tensor=2", 8, "needs 4 devices but 8 are available"),
        ("data=4,tensor=4", 8, "needs 16 devices"),
        ("data=-1,tensor=3", 8, "not divisible by 3"),
        ("data=-1,tensor=16", 8, "not divisible by 16"),
    ],
)
def test_resolve_rejects_a_wrong_product(text, n, fragment):
    with pytest.raises(UserError, match=fragment):
        parse_mesh(text).resolve(n)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("data=-1,tensor=-1", "more than one -1"),
        ("data=2,model=4", "unknown mesh axis 'model'"),
        ("data=two", "not an integer"),
        ("data=1.5", "not an integer"),
        ("data=", "not an integer"),
        ("data", "not name=size"),
        ("=2", "not name=size"),
        ("", "not name=size"),
        ("data=2,,tensor=4", "not name=size"),
        ("data=0", "sizes are positive or -1"),
        ("data=-2", "sizes are positive or -1"),
        ("data=2,data=4", "repeated"),
    ],
)
def test_parse_errors_name_the_problem(text, fragment):
    with pytest.raises(UserError, match=fragment) as e:
        parse_mesh(text)
    assert "\n" not in str(e.value)


def test_empty_mesh_spec_is_an_error():
    with pytest.raises(UserError, match="mesh is empty"):
        MeshSpec(axes=())


def test_make_mesh_has_auto_axes_and_fills_minus_one():
    mesh = make_mesh("data=-1,tensor=4")
    assert dict(mesh.shape) == {"data": 2, "tensor": 4}
    assert mesh.axis_names == ("data", "tensor")
    assert all(t == AxisType.Auto for t in mesh.axis_types)
    assert mesh.devices.size == 8


def test_make_mesh_on_a_subset_of_devices():
    devices = jax.devices()[:4]
    mesh = make_mesh(parse_mesh("data=2,tensor=2"), devices=devices)
    assert dict(mesh.shape) == {"data": 2, "tensor": 2}
    assert sorted(d.id for d in mesh.devices.flat) == sorted(d.id for d in devices)
    assert all(t == AxisType.Auto for t in mesh.axis_types)


def test_make_mesh_rejects_a_wrong_device_count():
    with pytest.raises(UserError, match="needs 3 devices but 8"):
        make_mesh("data=3")


# ---------------------------------------------------------------------------------------------
# Rule sets by hand: logical names -> PartitionSpec


@pytest.fixture(scope="module")
def mesh24():
    return make_mesh("data=2,tensor=4")


def test_rule_set_registry():
    assert set(RULE_SETS) == {"dp", "fsdp", "tp", "tp_sp", "fsdp_tp", "primepar"}
    for name in RULE_SETS:
        assert get_rules(name).name == name
    with pytest.raises(UserError, match="unknown rule set 'zero'"):
        get_rules("zero")


# (rule set, logical names, param spec, activation spec) on a data=2,tensor=4 mesh.
HAND_TABLE = [
    ("tp", ("embed", "heads", "head_dim"), P(None, "tensor", None), P(None, "tensor", None)),
    ("tp", ("heads", "head_dim", "embed"), P("tensor", None, None), P("tensor", None, None)),
    ("tp", ("embed", "kv_heads", "head_dim"), P(None, "tensor", None), P(None, "tensor", None)),
    ("tp", ("embed", "mlp"), P(None, "tensor"), P(None, "tensor")),
    ("tp", ("vocab", "embed"), P("tensor", None), P("tensor", None)),
    ("tp", ("batch", "seq", "embed"), P(None, None, None), P("data", None, None)),
    ("tp", ("layers", "embed", "mlp"), P(None, None, "tensor"), P(None, None, "tensor")),
    ("tp_sp", ("batch", "seq", "embed"), P(None, None, None), P("data", "tensor", None)),
    ("tp_sp", ("embed", "mlp"), P(None, "tensor"), P(None, "tensor")),
    ("fsdp", ("embed", "mlp"), P("data", None), P(None, None)),
    ("fsdp", ("vocab", "embed"), P(None, "data"), P(None, None)),
    ("fsdp", ("batch", "seq", "embed"), P(None, None, "data"), P("data", None, None)),
    ("fsdp_tp", ("embed", "mlp"), P("data", "tensor"), P(None, "tensor")),
    ("fsdp_tp", ("heads", "head_dim", "embed"), P("tensor", None, "data"), P("tensor", None, None)),
    ("dp", ("embed", "mlp"), P(None, None), P(None, None)),
    ("dp", ("batch", None, "vocab"), P(None, None, None), P("data", None, None)),
    ("tp", ("norm",), P(None), P(None)),
    ("tp", ("pos", "embed"), P(None, None), P(None, None)),
]


@pytest.mark.parametrize("name, logical, param, act", HAND_TABLE)
def test_rules_by_hand(mesh24, name, logical, param, act):
    rules = get_rules(name)
    assert rules.param_spec(logical, mesh24) == param
    assert rules.act_spec(logical, mesh24) == act


def test_specs_without_a_mesh_keep_every_axis():
    assert megatron().act_spec(("batch", "seq", "mlp")) == P(("data", "expert"), None, "tensor")
    assert fsdp().param_spec(("embed", "mlp")) == P("data", None)


def test_rule_sets_take_the_mesh_axis_names():
    rules = megatron(data="dp", tensor="mp", expert="ep")
    assert rules.param_spec(("embed", "heads", "head_dim")) == P(None, "mp", None)
    assert rules.act_spec(("batch", None)) == P(("dp", "ep"), None)
    assert rules.param_spec(("expert", "embed", "mlp")) == P("ep", None, "mp")


@pytest.mark.parametrize("mesh_text", ["data=8", "data=8,tensor=1", "data=1,tensor=8"])
def test_axes_absent_or_of_size_one_are_dropped(mesh_text):
    mesh = make_mesh(mesh_text)
    rules = get_rules("fsdp_tp")
    want_tensor = "tensor" if dict(mesh.shape).get("tensor", 1) > 1 else None
    want_data = "data" if dict(mesh.shape).get("data", 1) > 1 else None
    assert rules.param_spec(("embed", "mlp"), mesh) == P(want_data, want_tensor)
    assert rules.act_spec(("batch", "seq", "mlp"), mesh) == P(want_data, None, want_tensor)


def test_several_mesh_axes_for_one_name():
    rules = ShardingRules(name="custom", params=(), activations=(("batch", ("data", "fsdp")),))
    assert rules.act_spec(("batch", None), make_mesh("data=2,fsdp=4")) == P(("data", "fsdp"), None)
    # With one of the two axes missing the name falls back to the other alone.
    assert rules.act_spec(("batch", None), make_mesh("data=8")) == P("data", None)
    assert rules.act_spec(("batch", None), make_mesh("tensor=8")) == P(None, None)


def test_an_axis_used_twice_raises():
    rules = ShardingRules(name="bad", params=(("embed", "data"), ("mlp", "data")), activations=())
    with pytest.raises(UserError, match="map mesh axis 'data' twice"):
        rules.param_spec(("embed", "mlp"))
    with pytest.raises(UserError, match="twice"):
        rules.param_spec(("embed", "mlp"), make_mesh("data=2,tensor=4"))
    # When the mesh lacks the axis it is dropped first, so there is no clash.
    assert rules.param_spec(("embed", "mlp"), make_mesh("tensor=8")) == P(None, None)
    # Using the same logical name twice in one tensor clashes too.
    with pytest.raises(UserError, match="twice"):
        fsdp().param_spec(("embed", "embed"))


def test_unknown_logical_name_in_rules_is_an_error():
    with pytest.raises(UserError, match="unknown logical axis 'model'"):
        ShardingRules(name="x", params=(("model", "tensor"),), activations=())
    with pytest.raises(UserError, match="activation rule"):
        ShardingRules(name="x", params=(), activations=(("hidden", "tensor"),))


def test_every_rule_set_uses_only_the_vocabulary():
    for make in RULE_SETS.values():
        rules = make()
        for name, _ in rules.params + rules.activations:
            assert name in LOGICAL_AXES


def test_fsdp_params_and_activations_differ():
    # The reason the tables are separate: FSDP shards weights on embed, activations on batch.
    rules = get_rules("fsdp")
    assert dict(rules.params) == {"embed": "data"}
    assert dict(rules.activations) == {"batch": "data"}


def test_flax_rules_list_every_logical_name():
    rules = get_rules("tp_sp")
    params = dict(rules.flax_rules())
    assert set(params) == set(LOGICAL_AXES)
    # Without a mesh the axes only MoE meshes have are left out (Flax fails on absent axes).
    assert {k: v for k, v in params.items() if v} == {
        k: v for k, v in rules.params if v not in OPTIONAL_AXES}
    assert dict(rules.flax_rules("activations"))["seq"] == "tensor"
    assert dict(rules.flax_rules("activations"))["batch"] == "data"
    moe = make_mesh("data=2,expert=2,tensor=2")
    assert dict(rules.flax_rules("activations", moe))["batch"] == ("data", "expert")
    assert dict(rules.flax_rules("params", moe))["expert"] == "expert"
    mesh = make_mesh("data=8")  # no tensor axis: Flax would fail on it, so it is dropped
    assert dict(rules.flax_rules("params", mesh))["heads"] is None
    with pytest.raises(UserError, match="rule kind 'grads'"):
        rules.flax_rules("grads")


# ---------------------------------------------------------------------------------------------
# spec_divides


@pytest.mark.parametrize(
    "shape, spec, expected",
    [
        ((8, 8), P("data", "tensor"), None),
        ((8, 6), P("data", "tensor"), 1),
        ((3, 8), P("data", "tensor"), 0),
        ((3, 6), P(None, None), None),
        ((16,), P(("data", "tensor")), None),
        ((12,), P(("data", "tensor")), 0),
        ((4, 5, 7), P("data"), None),  # a short spec leaves trailing dims unsharded
        ((4, 5, 7), P(), None),
    ],
)
def test_spec_divides(mesh24, shape, spec, expected):
    assert spec_divides(shape, spec, mesh24) == expected


# ---------------------------------------------------------------------------------------------
# use_rules / constrain


def test_constrain_is_identity_outside_use_rules():
    x = jnp.ones((4, 8, 16))
    assert active_rules() is None
    assert constrain(x, ("batch", "seq", "embed")) is x

    def f(x):
        return constrain(x, ("batch", "seq", "embed"))

    assert "sharding_constraint" not in jax.jit(f).lower(x).as_text()


def test_use_rules_nests_and_resets(mesh24):
    tp, sp = get_rules("tp"), get_rules("tp_sp")
    with use_rules(tp, mesh24):
        assert active_rules() == (tp, mesh24)
        with use_rules(sp, mesh24):
            assert active_rules() == (sp, mesh24)
        assert active_rules() == (tp, mesh24)
    assert active_rules() is None


@pytest.mark.parametrize(
    "name, logical, expected",
    [
        ("tp", ("batch", None, "mlp"), P("data", None, "tensor")),
        ("tp", ("batch", "seq", "embed"), P("data", None, None)),
        ("tp_sp", ("batch", "seq", "embed"), P("data", "tensor", None)),
        ("fsdp", ("batch", "seq", "embed"), P("data", None, None)),
        ("dp", ("batch", None, "mlp"), P("data", None, None)),
    ],
)
def test_constrain_applies_named_sharding_inside_jit(mesh24, name, logical, expected):
    rules = get_rules(name)

    # A fresh function per case: `constrain` reads the rules when the function is traced.
    def f(x):
        return constrain(x * 2.0, logical)

    x = jnp.arange(8 * 16 * 32, dtype=jnp.float32).reshape(8, 16, 32)
    with use_rules(rules, mesh24):
        y = jax.jit(f)(x)
    assert isinstance(y.sharding, NamedSharding)
    assert y.sharding.is_equivalent_to(NamedSharding(mesh24, expected), y.ndim)
    assert y.sharding.mesh.shape == mesh24.shape
    assert jnp.array_equal(y, 2.0 * x)


def test_constrain_shows_in_the_lowered_program(mesh24):
    def f(x):
        return constrain(x, ("batch", None, "mlp"))

    with use_rules(get_rules("tp"), mesh24):
        text = jax.jit(f).lower(jnp.ones((8, 4, 16))).as_text()
    # Shardy form: one sharding_constraint with dims {data}, {}, {tensor}.
    assert "sharding_constraint" in text
    assert '[{"data"}, {}, {"tensor"}]' in text


def test_constrain_leaves_non_divisible_shapes_alone(mesh24):
    x = jnp.ones((1, 8, 16))  # a batch of 1 cannot split over data=2
    with use_rules(get_rules("tp"), mesh24):
        assert constrain(x, ("batch", "seq", "embed")) is x


def test_constrain_checks_the_rank(mesh24):
    with use_rules(get_rules("tp"), mesh24):
        with pytest.raises(ValueError, match="do not match shape"):
            constrain(jnp.ones((4, 8)), ("batch", "seq", "embed"))
