"""parallelize() on two models written the way users write Flax NNX, not the way models/ is:

- `ListNet`: an `nnx.List` of blocks of plain `nnx.Linear` layers, no logical names (the tensor
  map comes from shapes and data flow), learned embedding, untied head;
- `StackNet`: logical names on every kernel (`nnx.with_partitioning`), blocks stacked by
  `nnx.vmap` and run by `nnx.scan`, a causal mask passed to every block, tied embedding.

Loss and every gradient equal the unparallelized model's (`nnx.value_and_grad` on one device)
to 1e-5 of the largest element of each, on data=2,stage=2,tensor=2 and stage=4,tensor=2; 20
AdamW steps agree to 1e-4 in loss; bad input is one line naming what and the fix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from oases_jax.errors import UserError
from oases_jax.mesh import make_mesh
from oases_jax.training.parallelize import Plan, parallelize

V, D, HEADS, F = 32, 16, 4, 48


class Block(nnx.Module):
    """Pre-norm attention and MLP from plain Linear layers (no head structure in the kernels:
    q/k/v/o are 16x16, heads come from a reshape)."""

    def __init__(self, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.q = nnx.Linear(D, D, rngs=rngs)
        # No key bias: its gradient is zero in exact arithmetic (softmax ignores a shift shared
        # by every key), so it holds rounding noise no relative bound can pin.
        self.k = nnx.Linear(D, D, use_bias=False, rngs=rngs)
        self.v = nnx.Linear(D, D, rngs=rngs)
        self.o = nnx.Linear(D, D, rngs=rngs)
        self.ln2 = nnx.LayerNorm(D, rngs=rngs)
        self.fc1 = nnx.Linear(D, F, rngs=rngs)
        self.fc2 = nnx.Linear(F, D, rngs=rngs)

    def __call__(self, x):
        b, n, _ = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).reshape(b, n, HEADS, D // HEADS) for f in (self.q, self.k, self.v))
        w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(D / HEADS), axis=-1)
        x = x + self.o(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, n, D))
        return x + self.fc2(jax.nn.gelu(self.fc1(self.ln2(x))))


class ListNet(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
        self.ln_f = nnx.LayerNorm(D, rngs=rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _named(*names):
    return nnx.with_partitioning(nnx.initializers.normal(0.3), names)


class Layer(nnx.Module):
    """Attention with [D, H, K] kernels and a SwiGLU MLP, every kernel named."""

    def __init__(self, rngs: nnx.Rngs):
        hk = (HEADS, D // HEADS)
        ones = nnx.with_partitioning(nnx.initializers.ones, ("norm",))
        self.norm1 = nnx.RMSNorm(D, scale_init=ones, rngs=rngs)
        self.wq, self.wk, self.wv = (
            nnx.LinearGeneral(D, hk, use_bias=False, rngs=rngs,
                              kernel_init=_named("embed", "heads", "head_dim"))
            for _ in range(3))
        self.wo = nnx.LinearGeneral(hk, D, axis=(-2, -1), use_bias=False, rngs=rngs,
                                    kernel_init=_named("heads", "head_dim", "embed"))
        self.norm2 = nnx.RMSNorm(D, scale_init=ones, rngs=rngs)
        self.gate = nnx.Linear(D, F, use_bias=False, kernel_init=_named("embed", "mlp"),
                               rngs=rngs)
        self.up = nnx.Linear(D, F, use_bias=False, kernel_init=_named("embed", "mlp"), rngs=rngs)
        self.down = nnx.Linear(F, D, use_bias=False, kernel_init=_named("mlp", "embed"),
                               rngs=rngs)

    def __call__(self, x, mask):
        h = self.norm1(x)
        s = jnp.einsum("bqhd,bkhd->bhqk", self.wq(h), self.wk(h)) / np.sqrt(D // HEADS)
        p = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1)
        x = x + self.wo(jnp.einsum("bhqk,bkhd->bqhd", p, self.wv(h)))
        h = self.norm2(x)
        return x + self.down(jax.nn.silu(self.gate(h)) * self.up(h))


class StackNet(nnx.Module):
    def __init__(self, layers: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(V, D, embedding_init=_named("vocab", "embed"), rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def stack(key):
            return Layer(nnx.Rngs(key))

        self.layers = stack(jax.random.split(rngs.params(), layers))
        self.norm = nnx.RMSNorm(D, rngs=rngs)

    def __call__(self, tokens):
        n = tokens.shape[1]
        mask = jnp.tril(jnp.ones((n, n), bool))

        @nnx.scan(in_axes=(0, nnx.Carry, None), out_axes=nnx.Carry)
        def run(layer, x, mask):
            return layer(x, mask)

        return self.embed.attend(self.norm(run(self.layers, self.embed(tokens), mask)))


def next_token_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def list_net():
    return ListNet(4, nnx.Rngs(0)), 16  # model, batch rows


def stack_net():
    with nnx.use_eager_sharding(False):  # the names are logical, not mesh axes
        return StackNet(6, nnx.Rngs(1)), 10  # M = 5 = S+1 on stage=4; stages 2,2,1,1


MODELS = {"list": list_net, "stack": stack_net}


def _tokens(rows: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (rows, 9)).astype(np.int32)


def _reference(model, tokens):
    """Loss and gradients of the model as written, on one device."""
    graphdef, state = nnx.split(model)
    return jax.jit(jax.value_and_grad(lambda s, t: next_token_loss(nnx.merge(graphdef, s), t)))(
        state, tokens)


def _assert_equal(model, run, params, tokens):
    ref_loss, ref = _reference(model, tokens)
    loss, grads = run.grads(params, tokens)
    assert abs(float(loss) - float(ref_loss)) <= 1e-5 * abs(float(ref_loss))
    got = run.model_state(grads)
    ref_leaves = jax.tree_util.tree_leaves_with_path(ref)
    assert len(ref_leaves) == len(jax.tree.leaves(got))
    for (path, a), b in zip(ref_leaves, jax.tree.leaves(got), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape
        err = np.abs(a - b).max() / np.abs(a).max()
        assert err <= 1e-5, (jax.tree_util.keystr(path), err)


FAST = [("list", "data=2,stage=2,tensor=2"), ("stack", "stage=4,tensor=2")]
SLOW = [("list", "stage=4,tensor=2"), ("stack", "data=2,stage=2,tensor=2")]


@pytest.mark.parametrize(("name", "mesh"), [
    *FAST, *(pytest.param(*case, marks=pytest.mark.slow) for case in SLOW)])
def test_equals_unparallelized(name, mesh):
    model, rows = MODELS[name]()
    tokens = _tokens(rows)
    run = parallelize(model, next_token_loss, tokens, make_mesh(mesh))
    _assert_equal(model, run, run.init(model)["params"], tokens)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "mesh"), FAST)
def test_twenty_adamw_steps(name, mesh):
    model, rows = MODELS[name]()
    tx = optax.adamw(3e-3, weight_decay=0.1)
    run = parallelize(model, next_token_loss, _tokens(rows), make_mesh(mesh), optimizer=tx)
    state = run.init(model)
    graphdef, params = nnx.split(model)
    opt = tx.init(params)

    @jax.jit
    def reference(params, opt, tokens):
        loss, g = jax.value_and_grad(lambda p: next_token_loss(nnx.merge(graphdef, p),
                                                               tokens))(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    for i in range(20):
        tokens = _tokens(rows, seed=100 + i)
        state, metrics = run.step(state, tokens)
        params, opt, ref_loss = reference(params, opt, tokens)
        assert abs(float(metrics["loss"]) - float(ref_loss)) <= 1e-4, (i, metrics, ref_loss)
    run.update(model, state)  # the trained values back into the user's model
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("plan", [
    Plan(schedule="interleaved", virtual_stages=2, microbatches=4),
    Plan(schedule="merak", microbatches=4, remat_ratios=(1,)),  # shifted CP, stage-aware remat
    Plan(schedule="gpipe", stage_layers=(3, 1)),  # uneven stages
], ids=["interleaved", "merak-remat", "gpipe-uneven"])
def test_other_plans_equal_unparallelized(plan):
    model, rows = list_net()
    tokens = _tokens(rows)
    run = parallelize(model, next_token_loss, tokens, make_mesh("data=2,stage=2,tensor=2"),
                      plan=plan)
    _assert_equal(model, run, run.init(model)["params"], tokens)


def test_report_says_what_it_mapped():
    model, rows = list_net()
    run = parallelize(model, next_token_loss, _tokens(rows), make_mesh("stage=2,tensor=4"))
    text = run.report()
    for layer, kind in (("q", "column"), ("k", "column"), ("v", "column"), ("o", "row"),
                        ("fc1", "column"), ("fc2", "row")):
        line = next(x for x in text.splitlines() if f"blocks[*].{layer}.kernel " in x)
        assert f": {kind} (by shape and data flow)" in line, line
    assert "blocks: blocks, 4 x Block (list)" in text
    assert "plan: 1f1b, M=4, stage layers [2, 2]" in text  # auto: 8 rows per stage step
    model, rows = stack_net()
    text = parallelize(model, next_token_loss, _tokens(rows),
                       make_mesh("stage=4,tensor=2")).report()
    assert "layers.wo.kernel 16->16: row (logical names ('heads', 'head_dim', 'embed'))" in text
    assert "stage layers [2, 2, 1, 1]" in text and "M=5" in text
    assert "embed.embedding (32, 16): split on dim 0" in text


class Flat(nnx.Module):
    def __init__(self, rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.mlp = Block(rngs)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.mlp(self.tok(tokens)))


def _one_line_error(model, mesh: str, rows: int = 8) -> str:
    with pytest.raises(UserError) as err:
        parallelize(model, next_token_loss, _tokens(rows), make_mesh(mesh))
    text = str(err.value)
    assert "\n" not in text
    return text


def test_no_repeated_block_is_one_line():
    text = _one_line_error(Flat(nnx.Rngs(0)), "data=2,stage=2,tensor=2")
    assert "found no repeated block in Flat" in text and "nnx.List" in text


class Wide(nnx.Module):
    def __init__(self, width, rngs, names=None):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(D, width, rngs=rngs, kernel_init=(
            nnx.with_partitioning(init, names[0]) if names else init))
        self.down = nnx.Linear(width, D, rngs=rngs, kernel_init=(
            nnx.with_partitioning(init, names[1]) if names else init))

    def __call__(self, x):
        return x + self.down(jax.nn.relu(self.up(x)))


class WideNet(nnx.Module):
    def __init__(self, width, rngs, names=None):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.blocks = nnx.List([Wide(width, rngs, names) for _ in range(4)])
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens)
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_layer_that_does_not_split_is_one_line_and_names_fix():
    text = _one_line_error(WideNet(30, nnx.Rngs(0)), "stage=2,tensor=4")
    assert "blocks[*].up.kernel (16->30, column-parallel by its shape)" in text
    assert "dimension 1 (30) is not divisible by 4" in text
    assert "nnx.with_partitioning(init, (None, None))" in text
    # The fix it names: logical names decide instead of the shape (here: keep both whole).
    with nnx.use_eager_sharding(False):
        fixed = WideNet(30, nnx.Rngs(0), names=((None, None), (None, None)))
    report = parallelize(fixed, next_token_loss, _tokens(8), make_mesh("stage=2,tensor=4")).report()
    assert "blocks[*].up.kernel 16->30: replicated (logical names (None, None))" in report


def test_heads_that_do_not_split_are_one_line():
    # 4 heads of 4 over tensor=8: the q/k/v columns split (16 / 8) but their heads do not.
    text = _one_line_error(ListNet(2, nnx.Rngs(0)), "tensor=8")
    assert "column-parallel blocks[*].q.kernel is reshaped" in text
    assert "4 heads do not divide over tensor=8" in text


def test_unknown_logical_name_is_one_line():
    with nnx.use_eager_sharding(False):
        model = WideNet(32, nnx.Rngs(0), names=(("embed", "hidden"), ("hidden", "embed")))
    text = _one_line_error(model, "data=2,stage=2,tensor=2")
    assert "['hidden']" in text and "logical axis names" in text


class SeqNet(nnx.Module):
    """Blocks in an nnx.Sequential, and a plain list under nnx.data of the same blocks."""

    def __init__(self, rngs, sequential: bool):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        blocks = [Wide(32, rngs) for _ in range(4)]
        self.body = nnx.Sequential(*blocks) if sequential else nnx.data(blocks)
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        x = self.tok(tokens)
        if isinstance(self.body, nnx.Sequential):
            return self.head(self.body(x))
        for b in self.body:
            x = b(x)
        return self.head(x)


class LaxScanNet(nnx.Module):
    """A stack built by nnx.vmap, run by jax.lax.scan over its split state."""

    def __init__(self, rngs):
        self.tok = nnx.Embed(V, D, rngs=rngs)
        self.stack = nnx.vmap(lambda key: Wide(32, nnx.Rngs(key)))(jax.random.split(
            rngs.params(), 4))
        self.head = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, tokens):
        graphdef, state = nnx.split(self.stack)
        x, _ = jax.lax.scan(lambda x, s: (nnx.merge(graphdef, s)(x), None),
                            self.tok(tokens), state)
        return self.head(x)


@pytest.mark.parametrize(("model", "found"), [
    (lambda: SeqNet(nnx.Rngs(0), True), "blocks: body.layers, 4 x Wide (list)"),
    (lambda: SeqNet(nnx.Rngs(0), False), "blocks: body, 4 x Wide (list)"),
    (lambda: LaxScanNet(nnx.Rngs(0)), "blocks: stack, 4 x Wide (stacked)"),
], ids=["sequential", "nnx.data-list", "lax.scan"])
def test_finds_blocks_in_other_containers(model, found):
    run = parallelize(model(), next_token_loss, _tokens(8), make_mesh("data=2,stage=2,tensor=2"))
    text = run.report()
    assert found in text, text
    assert "up.kernel 16->32: column" in text and "down.kernel 32->16: row" in text


@pytest.mark.parametrize(("plan", "words"), [
    (Plan(split_head=True), "drop split_head=True from the Plan"),
    (Plan(backward_ticks=2), "drop backward_ticks=2 from the Plan"),
    (Plan(schedule="gpipe_spmd"), "runs its stages with the tick executor"),
])
def test_plan_settings_it_cannot_run_are_one_line(plan, words):
    model, rows = list_net()
    with pytest.raises(UserError, match=words) as err:
        parallelize(model, next_token_loss, _tokens(rows), make_mesh("stage=2,tensor=4"),
                    plan=plan)
    assert "\n" not in str(err.value)
