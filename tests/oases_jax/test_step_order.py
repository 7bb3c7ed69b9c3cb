"""Sub-batch schedules as plain data, and the executor against a plain loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from oases_jax import step_order


def test_oases_order_and_pretty():
    s = step_order.oases(2)
    assert [(st.op, st.sub_batch) for st in s.steps] == [
        ("attn", 0),
        ("attn", 1),
        ("mlp", 0),
        ("mlp", 1),
    ]
    text = s.pretty()
    assert "attn[1]   (hides the collective of attn[0])" in text
    assert "mlp[0]   (hides the collective of attn[1])" in text
    assert step_order.sequential().steps == (step_order.Step("attn", 0), step_order.Step("mlp", 0))
    with pytest.raises(ValueError):
        step_order.oases(0)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_executor_equals_unsplit_layer(k):
    x = jax.random.normal(jax.random.key(0), (8, 5, 3))
    ops = {"attn": lambda x: jnp.tanh(x) * 2.0, "mlp": lambda x: x**2 - 1.0}
    want = x + ops["attn"](x)
    want = want + ops["mlp"](want)
    got = step_order.run(step_order.oases(k), x, ops)
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_sub_batches_take_strided_rows():
    seen = []
    x = jnp.arange(8.0).reshape(8, 1, 1)
    step_order.run(
        step_order.oases(2), x, {"attn": lambda v: seen.append(v) or 0 * v, "mlp": lambda v: 0 * v}
    )
    assert [v.ravel().tolist() for v in seen] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_batch_must_split():
    with pytest.raises(ValueError, match="does not split into 3"):
        step_order.run(step_order.oases(3), jnp.ones((4, 2, 2)), {"attn": abs, "mlp": abs})


@pytest.mark.parametrize("k", [2, 4])
def test_pipelined_stack_equals_layer_by_layer(k):
    """Three layers with the sub-batches kept split and each layer's last step left pending
    for the next (`run_overlapped`) compute what three `run` calls compute."""
    x = jax.random.normal(jax.random.key(0), (8, 5, 3))
    layers = [{"attn": lambda x, s=s: jnp.tanh(x) * s, "mlp": lambda x, s=s: x**2 / (4 + s)}
              for s in (1.0, 2.0, 3.0)]
    s = step_order.oases(k)
    want = x
    for ops in layers:
        want = step_order.run(s, want, ops)
    xs, pending = step_order.split(s, x), None
    for ops in layers:
        xs, pending = step_order.run_overlapped(
            s, xs, pending, ops, defer=lambda x, ops=ops: ("owed", ops["mlp"](x)),
            complete=lambda p: p[1])
        assert pending[0] == "owed"
    got = step_order.join(step_order.finish_pending(s, xs, pending, complete=lambda p: p[1]))
    np.testing.assert_allclose(got, want, rtol=1e-6)
