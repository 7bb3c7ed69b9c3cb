"""The complete example of docs/parallelize.md runs as written (8 CPU devices, mesh
data=2,stage=2,tensor=2, plan "auto"), and its 20 AdamW steps agree with the same model trained
unparallelized: losses to 1e-4, the parameters it writes back into the model to 1e-4."""

from __future__ import annotations

import pathlib
import re

import jax
import numpy as np
import optax
from flax import nnx

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "parallelize.md"


def example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    return next(b for b in blocks if "parallelize(model" in b)


def test_the_documented_example_trains_as_the_plain_model(capsys):
    ns: dict = {"__name__": "docs_parallelize"}
    exec(compile(example(), str(DOC), "exec"), ns)  # noqa: S102 - our own documentation
    out = capsys.readouterr().out
    assert "blocks: blocks, 4 x Block (list)" in out and "plan: 1f1b, M=4" in out
    assert "blocks[*].up.kernel 32->128: column" in out

    model = ns["Model"](rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    tx = optax.adamw(3e-3)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt, batch):
        loss, g = jax.value_and_grad(lambda p: ns["loss_fn"](nnx.merge(graphdef, p), batch))(
            params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for batch in ns["batches"](20):
        params, opt, loss = step(params, opt, batch)
        losses.append(float(loss))
    np.testing.assert_allclose(ns["losses"], losses, atol=1e-4, rtol=0)
    assert losses[-1] < 0.5 * losses[0]
    trained = jax.tree.leaves(nnx.state(ns["model"]))
    for a, b in zip(trained, jax.tree.leaves(params), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
