"""The rule sets applied to Flax models this project did not write (NNX and Linen), through the
same logical names: parameter shardings come out as the rules say, and sharded == unsharded."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.mesh import make_mesh
from oases_jax.models.sharding import param_shardings
from oases_jax.rules import RULE_SETS, constrain, get_rules, use_rules

D, F, B = 16, 64, 8

# Expected parameter specs on a data=2,tensor=4 mesh, written by hand from the rule tables:
# kernels (embed, mlp) and (mlp, embed), biases (mlp,) and (embed,).
EXPECTED = {
    "dp": {"up": (P(), P()), "down": (P(), P())},
    "fsdp": {"up": (P("data", None), P()), "down": (P(None, "data"), P("data"))},
    "tp": {"up": (P(None, "tensor"), P("tensor")), "down": (P("tensor", None), P())},
    "tp_sp": {"up": (P(None, "tensor"), P("tensor")), "down": (P("tensor", None), P())},
    "fsdp_tp": {
        "up": (P("data", "tensor"), P("tensor")),
        "down": (P("tensor", "data"), P("data")),
    },
}


# Rule sets a user applies to a plain model on a (data, tensor) mesh. `primepar` needs its own
# tp_row x tp_col square and the skewed weight layout: tests/training/test_primepar_training.py.
USER_RULE_SETS = [name for name in RULE_SETS if name != "primepar"]
assert set(USER_RULE_SETS) == set(EXPECTED)


@pytest.fixture(scope="module")
def mesh():
    return make_mesh("data=2,tensor=4")


@pytest.fixture(scope="module")
def x_BD():
    return jax.random.normal(jax.random.key(1), (B, D), jnp.float32)


def _check(sharding, mesh, spec, ndim):
    assert isinstance(sharding, NamedSharding)
    assert sharding.is_equivalent_to(NamedSharding(mesh, spec), ndim), (sharding.spec, spec)


# ---------------------------------------------------------------------------------------------
# (a) A user-written Flax NNX module annotated with `nnx.with_partitioning`.


class UserMLP(nnx.Module):
    def __init__(self, d: int, f: int, *, rngs: nnx.Rngs):
        kernel, bias = nnx.initializers.lecun_normal(), nnx.initializers.normal(0.1)
        self.up = nnx.Linear(
            d,
            f,
            kernel_init=nnx.with_partitioning(kernel, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(bias, ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(
            f,
            d,
            kernel_init=nnx.with_partitioning(kernel, ("mlp", "embed")),
            bias_init=nnx.with_partitioning(bias, ("embed",)),
            rngs=rngs,
        )

    def __call__(self, x_BD):
        h_BF = constrain(jax.nn.gelu(self.up(x_BD)), ("batch", "mlp"))
        return constrain(self.down(h_BF), ("batch", "embed"))


def _nnx_shardings(state: nnx.State, rules, mesh) -> nnx.State:
    """Each Variable's `out_sharding` names through `rules.param_spec` (the route that drops mesh
    axes the mesh lacks, as the project's own models do)."""

    def one(var: nnx.Variable) -> nnx.Variable:
        names = var.get_metadata()["out_sharding"]
        return var.replace(NamedSharding(mesh, rules.param_spec(names, mesh)))

    return jax.tree.map(one, state, is_leaf=lambda v: isinstance(v, nnx.Variable))


def _nnx_abstract():
    with nnx.use_eager_sharding(False):  # logical names are not mesh axes: shard later
        return nnx.split(nnx.eval_shape(lambda: UserMLP(D, F, rngs=nnx.Rngs(0))))


def _nnx_sharded(shardings: nnx.State, mesh):
    graphdef, _ = _nnx_abstract()

    def create():
        with nnx.use_eager_sharding(False):
            return nnx.state(UserMLP(D, F, rngs=nnx.Rngs(0)))

    with jax.set_mesh(mesh):
        state = jax.jit(create, out_shardings=shardings)()
    return graphdef, state


@pytest.mark.parametrize("name", USER_RULE_SETS)
def test_nnx_user_module_under_rules(mesh, x_BD, name):
    rules = get_rules(name)
    graphdef, abstract = _nnx_abstract()
    shardings = _nnx_shardings(abstract, rules, mesh)
    # The project's helper does the same for any NNX state that carries `out_sharding` names.
    helper = param_shardings(abstract, rules, mesh)
    assert jax.tree.map(lambda s: s.spec, shardings) == jax.tree.map(lambda s: s.spec, helper)

    graphdef, state = _nnx_sharded(shardings, mesh)
    for layer, (kernel_spec, bias_spec) in EXPECTED[name].items():
        _check(state[layer]["kernel"].get_value().sharding, mesh, kernel_spec, 2)
        _check(state[layer]["bias"].get_value().sharding, mesh, bias_spec, 1)

    with nnx.use_eager_sharding(False):
        reference = UserMLP(D, F, rngs=nnx.Rngs(0))  # unsharded, on one device
    want = reference(x_BD)
    sharded = dict(nnx.to_flat_state(state))
    for path, ref_var in nnx.to_flat_state(nnx.state(reference)):
        # Same draws; jitted (sharded) and eager initialisers may round the scaling differently
        # in the last bit (seen with jax 0.11.2).
        np.testing.assert_allclose(sharded[path].get_value(), ref_var.get_value(), rtol=1e-6)

    @jax.jit
    def forward(state, x_BD):
        with use_rules(rules, mesh):  # bound at trace time, inside the jitted function
            return nnx.merge(graphdef, state)(x_BD)

    x_sharded = jax.device_put(x_BD, NamedSharding(mesh, rules.act_spec(("batch", None), mesh)))
    with jax.set_mesh(mesh):
        got = forward(state, x_sharded)
    _check(got.sharding, mesh, P("data", None), 2)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_nnx_logical_axis_rules_route_when_every_name_is_mapped(mesh):
    # fsdp_tp maps both names the module uses (embed, mlp), so Flax's own route agrees.
    rules = get_rules("fsdp_tp")
    _, abstract = _nnx_abstract()
    with nnx.logical_axis_rules(rules.flax_rules()):
        specs = nnx.get_partition_spec(abstract)
        shardings = nnx.get_named_sharding(abstract, mesh)
    assert specs["up"]["kernel"].get_value() == P("data", "tensor")
    assert specs["down"]["kernel"].get_value() == P("tensor", "data")
    _, state = _nnx_sharded(shardings, mesh)
    for layer, (kernel_spec, bias_spec) in EXPECTED["fsdp_tp"].items():
        _check(state[layer]["kernel"].get_value().sharding, mesh, kernel_spec, 2)
        _check(state[layer]["bias"].get_value().sharding, mesh, bias_spec, 1)


def test_nnx_logical_axis_rules_route_with_unmapped_names(mesh):
    rules = get_rules("tp")
    _, abstract = _nnx_abstract()
    with nnx.logical_axis_rules(rules.flax_rules()):
        shardings = nnx.get_named_sharding(abstract, mesh)
    _check(shardings["up"]["kernel"].get_value(), mesh, P(None, "tensor"), 2)


# ---------------------------------------------------------------------------------------------
# (b) A user-written Flax Linen module with `nn.with_logical_partitioning` and
# `nn.with_logical_constraint`.


class LinenMLP(nn.Module):
    d: int
    f: int

    @nn.compact
    def __call__(self, x_BD):
        kernel, bias = nn.initializers.lecun_normal(), nn.initializers.normal(0.1)
        h_BF = nn.Dense(
            self.f,
            kernel_init=nn.with_logical_partitioning(kernel, ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(bias, ("mlp",)),
            name="up",
        )(x_BD)
        h_BF = nn.with_logical_constraint(jax.nn.gelu(h_BF), ("batch", "mlp"))
        y_BD = nn.Dense(
            self.d,
            kernel_init=nn.with_logical_partitioning(kernel, ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(bias, ("embed",)),
            name="down",
        )(h_BF)
        return nn.with_logical_constraint(y_BD, ("batch", "embed"))


@pytest.mark.parametrize("name", USER_RULE_SETS)
def test_linen_user_module_under_rules(mesh, x_BD, name):
    rules = get_rules(name)
    model, key = LinenMLP(D, F), jax.random.key(0)

    with nn.logical_axis_rules(rules.flax_rules("params")):
        abstract = jax.eval_shape(model.init, key, x_BD)
        logical = nn.get_partition_spec(abstract)
        shardings = nn.logical_to_mesh_sharding(logical, mesh, rules.flax_rules("params"))
        variables = jax.jit(model.init, out_shardings=shardings)(key, x_BD)

    assert logical["params"]["up"]["kernel"] == P("embed", "mlp")
    for layer, (kernel_spec, bias_spec) in EXPECTED[name].items():
        _check(variables["params"][layer]["kernel"].value.sharding, mesh, kernel_spec, 2)
        _check(variables["params"][layer]["bias"].value.sharding, mesh, bias_spec, 1)

    # Unsharded reference: same initial values, no rules, no mesh.
    reference = model.init(key, x_BD)
    for ref, got in zip(
        jax.tree.leaves(nn.unbox(reference)), jax.tree.leaves(nn.unbox(variables)), strict=True
    ):
        np.testing.assert_allclose(got, ref, rtol=1e-6)  # last-bit rounding, as above
    want = model.apply(reference, x_BD)

    x_sharded = jax.device_put(x_BD, NamedSharding(mesh, rules.act_spec(("batch", None), mesh)))
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules.flax_rules("activations")):
        got = jax.jit(model.apply)(variables, x_sharded)
    _check(got.sharding, mesh, P("data", None), 2)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_linen_constraint_follows_the_activation_rules(mesh, x_BD):
    # Under tp the hidden activation is split on mlp: the constraint appears in the program.
    rules = get_rules("tp")
    model = LinenMLP(D, F)
    variables = model.init(jax.random.key(0), x_BD)
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules.flax_rules("activations")):
        text = jax.jit(model.apply).lower(variables, x_BD).as_text()
    assert '[{"data"}, {"tensor"}]' in text
