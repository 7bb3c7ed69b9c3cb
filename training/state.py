"""The train step: gradient accumulation over micro-batches, clipping, AdamW; and sharded state."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.sharding import abstract_model, param_shardings
from models.transformer import cross_entropy
from oases_jax.stacks import Parallel, use_parallel

TrainState = (
    dict  # {"params": nnx.State, "opt_state": optax state, "step": int32, "rng": uint32[2]}
)


@dataclasses.dataclass(frozen=True)
class StepFns:
    """Compiled functions and the shardings they were compiled for."""

    train_step: Callable  # (state, batch_MBL) -> (state, metrics)
    eval_loss: Callable  # (params, batch_1BL) -> loss
    init_opt: Callable  # (params) -> opt_state
    state_shardings: TrainState
    batch_sharding: NamedSharding  # for [microbatches, batch, seq + 1]
    abstract_state: TrainState  # ShapeDtypeStructs with shardings, for restoring
    step_jit: Callable  # the jitted train step itself, for `.lower(...)` (call under the mesh)


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, tokens_BL: jax.Array, vocab: int):
    model = nnx.merge(graphdef, params)
    logits_BLV = model(tokens_BL[:, :-1])
    return cross_entropy(logits_BLV, tokens_BL[:, 1:], vocab)


def build_step_fns(cfg: ModelConfig, tx: optax.GradientTransformation,
                   parallel: Parallel) -> StepFns:
    """The jitted step, evaluation and optimizer init for `cfg` run as `parallel` says (its
    mesh, rule set and per-layer strategies)."""
    rules, mesh = parallel.rules, parallel.mesh
    graphdef, abstract_params = abstract_model(cfg)
    p_sh = param_shardings(abstract_params, rules, mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    o_sh = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        p_sh,
        transform_non_params=lambda _: replicated,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )
    state_sh = {"params": p_sh, "opt_state": o_sh, "step": replicated, "rng": replicated}
    batch_spec = rules.act_spec((None, "batch", None), mesh)
    batch_sh = NamedSharding(mesh, batch_spec)
    grad_fn = jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, t, cfg.vocab_size))

    def train_step(state: TrainState, batch_MBL: jax.Array):
        params = state["params"]
        if batch_MBL.shape[0] == 1:
            loss, grads = grad_fn(params, batch_MBL[0])
        else:

            def micro(acc, tokens_BL):
                loss, g = grad_fn(params, tokens_BL)
                return jax.tree.map(jnp.add, acc, (loss, g)), None

            zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(micro, zeros, batch_MBL)
            loss, grads = jax.tree.map(lambda x: x / batch_MBL.shape[0], (loss, grads))
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": state["rng"],
        }
        return new_state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

    def traced(fn):
        # Trace under the mesh, rules and layer strategies, so the model's `constrain` calls and
        # layer stack see them.
        def wrapper(*args):
            with use_parallel(parallel):
                return fn(*args)

        return wrapper

    with jax.set_mesh(mesh):
        step_jit = jax.jit(
            traced(train_step),
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, replicated),
            donate_argnums=0,
        )
        eval_jit = jax.jit(
            traced(lambda p, t: loss_fn(graphdef, p, t[0], cfg.vocab_size)),
            in_shardings=(p_sh, batch_sh),
            out_shardings=replicated,
        )
        init_opt = jax.jit(tx.init, in_shardings=(p_sh,), out_shardings=o_sh)

    def with_sharding(a, s):
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)

    abstract_state = {
        "params": jax.tree.map(with_sharding, abstract_params, p_sh),
        "opt_state": jax.tree.map(with_sharding, abstract_opt, o_sh),
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
    }
    return StepFns(
        train_step=_under_mesh(step_jit, mesh),
        step_jit=step_jit,
        eval_loss=_under_mesh(eval_jit, mesh),
        init_opt=_under_mesh(init_opt, mesh),
        state_shardings=state_sh,
        batch_sharding=batch_sh,
        abstract_state=abstract_state,
    )


def _under_mesh(fn: Callable, mesh: Mesh) -> Callable:
    def call(*args):
        with jax.set_mesh(mesh):
            return fn(*args)

    return call


def new_state(params: nnx.State, fns: StepFns, seed: int) -> TrainState:
    rng = jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32)
    replicated = fns.state_shardings["step"]
    return {
        "params": params,
        "opt_state": fns.init_opt(params),
        "step": jax.device_put(jnp.zeros((), jnp.int32), replicated),
        "rng": jax.device_put(rng, replicated),
    }
