"""Norms with hand-written backwards and activations that recompute their float32 internals in
the backward (`models.pointwise`): values and gradients equal plain autodiff of the same formulas
(float64 references), and a bf16 block saves no float32 copy of its [B, L, D] stream or
[B, L, F] hidden for the backward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from oases_jax.models import get_preset
from oases_jax.models.layers import Block, LayerNorm, RMSNorm, gelu, layer_norm, rms_norm, swiglu
from oases_jax.projections import bias_add

EPS = 1e-5


def _ln_ref(x, s, b):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS) * s + b


def _rms_ref(x, s):
    return x / jnp.sqrt((x**2).mean(-1, keepdims=True) + EPS) * s


def _grads(f, *args):
    return jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32) ** 2) / 2,
                    argnums=tuple(range(len(args))))(*args)


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 16, 64)) * 3 + 0.5
    s, b = 1 + 0.1 * rng.normal(size=64), 0.1 * rng.normal(size=64)
    return x, s, b


def _x64(fn):
    with jax.enable_x64():
        return fn()


def test_norms_equal_autodiff_of_the_formula(inputs):
    x, s, b = inputs

    def check():
        args = [jnp.asarray(a, jnp.float64) for a in (x, s, b)]
        # The checkpointed norms compute in float32 internally; compare against float64 plain
        # autodiff of the same formula at float32's precision.
        ln = _grads(lambda x, s, b: layer_norm(x, s, b, EPS), *args)
        ln_ref = _grads(_ln_ref, *args)
        rms = _grads(lambda x, s: rms_norm(x, s, EPS), *args[:2])
        rms_ref = _grads(_rms_ref, *args[:2])
        for got, want in [*zip(ln, ln_ref, strict=True), *zip(rms, rms_ref, strict=True)]:
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
        np.testing.assert_allclose(layer_norm(*args, EPS), _ln_ref(x, s, b), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(rms_norm(*args[:2], EPS), _rms_ref(x, s), rtol=1e-5, atol=1e-5)

    _x64(check)


def test_activations_equal_autodiff_of_the_formula(inputs):
    x, s, _ = inputs
    g, u = jnp.asarray(x, jnp.float32), jnp.asarray(x[::-1] * 0.5, jnp.float32)
    plain_swiglu = lambda g, u: g * jax.nn.sigmoid(g) * u  # noqa: E731
    plain_gelu = lambda h: 0.5 * h * (1 + jnp.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3)))  # noqa: E731
    for got, want in [(_grads(swiglu, g, u), _grads(plain_swiglu, g, u)),
                      (_grads(gelu, g), _grads(plain_gelu, g))]:
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())


def test_bias_gradient_is_the_sum_over_tokens(inputs):
    """bias_add's hand-written bias gradient (its own column reduction) equals autodiff's sum
    over every leading dim."""
    x, _, b = inputs
    y, bias = jnp.asarray(x, jnp.float32), jnp.asarray(b, jnp.float32)
    weight = jnp.asarray(np.random.default_rng(1).normal(size=x.shape), jnp.float32)
    got = jax.grad(lambda y, b: jnp.sum(bias_add(y, b) ** 2 * weight), argnums=(0, 1))(y, bias)
    want = jax.grad(lambda y, b: jnp.sum((y + b) ** 2 * weight), argnums=(0, 1))(y, bias)
    for a, w in zip(got, want, strict=True):
        np.testing.assert_allclose(a, w, rtol=1e-5, atol=1e-5 * np.abs(w).max())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_bf16_block_saves_no_float32_stream(family):
    """What a bf16 block keeps for its backward: nothing float32 as large as a [B, L, D] stream
    (before: three float32 copies per norm, and the activation's products)."""
    base = get_preset("tiny-llama" if family == "llama" else "tiny")
    cfg = base.replace(dtype="bfloat16", attention="xla")
    norm = RMSNorm if cfg.family == "llama" else LayerNorm
    graphdef, state = nnx.split(Block(cfg, norm, rngs=nnx.Rngs(0)))
    b, length, d = 2, 16, cfg.d_model

    def loss(state, x):
        ops = nnx.merge(graphdef, state).ops()
        x = x + ops["attn"](x)
        return jnp.sum((x + ops["mlp"](x)).astype(jnp.float32))

    x = jnp.ones((b, length, d), jnp.bfloat16)
    _, pullback = jax.vjp(loss, state, x)
    # The residuals the backward reads, activations only (parameters and their casts excluded).
    saved = [a for a in jax.tree.leaves(pullback) if a.ndim >= 3 and a.shape[:2] == (b, length)]
    f = cfg.ff_dim
    big_f32 = [a.shape for a in saved if a.dtype == jnp.float32 and a.shape[-1] in (d, f)]
    assert not big_f32, big_f32
    # The hidden keeps up, gate and their product (gated) or its input and biased input (GELU).
    hidden = [a.shape for a in saved if a.shape[-1] == f]
    assert len(hidden) == (3 if cfg.gated_mlp else 2), hidden


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
def test_weights_cast_once_give_the_same_step(preset, monkeypatch):
    """Casting the stacked weight matrices to bf16 once per step (`compute_weights`) computes
    what a cast at each use did: the same loss and the same float32 gradients (up to XLA's
    fusion choices, far inside bf16's precision), and float32 models are untouched."""
    import oases_jax.models.transformer as transformer
    from oases_jax.models.layers import compute_weights
    from oases_jax.models.transformer import Transformer, objective

    cfg = get_preset(preset).replace(dtype="bfloat16", attention="xla")
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)

    def step(params):
        return jax.value_and_grad(lambda p: objective(nnx.merge(graphdef, p), tokens)[0])(params)

    once_loss, once_grads = jax.jit(step)(params)
    monkeypatch.setattr(transformer, "compute_weights", lambda stacked, dtype: stacked)
    each_loss, each_grads = jax.jit(step)(params)
    np.testing.assert_allclose(once_loss, each_loss, rtol=1e-3)
    for a, b in zip(jax.tree.leaves(once_grads), jax.tree.leaves(each_grads), strict=True):
        assert a.dtype == b.dtype == jnp.float32
        np.testing.assert_allclose(a, b, rtol=0, atol=2e-2 * float(np.abs(b).max()) + 1e-30)
    stacked = nnx.split(model.blocks)[1]
    assert all(a.dtype == jnp.float32 for a in jax.tree.leaves(compute_weights(stacked, "float32")))
    cast = jax.tree.leaves(compute_weights(stacked, "bfloat16"))
    assert {a.dtype for a in cast if a.ndim >= 3} == {jnp.dtype(jnp.bfloat16)}
    assert {a.dtype for a in cast if a.ndim < 3} == {jnp.dtype(jnp.float32)}
    # One block (no stacking axis); the MoE router keeps float32 (its logits are float32).
    tree = {"router": jnp.zeros((4, 4)), "w_in": jnp.zeros((4, 8)), "b_in": jnp.zeros((8,))}
    one = compute_weights(tree, "bfloat16", lead=0)
    assert [one[k].dtype for k in ("router", "w_in", "b_in")] == [
        jnp.float32, jnp.bfloat16, jnp.float32]
