"""The train step: gradient accumulation over micro-batches, clipping, AdamW; and sharded state."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jax.sharding import PartitionSpec as P

from oases_jax.models.config import ModelConfig
from oases_jax.models.layers import compute_weights
from oases_jax.models.moe import LOSSES as MOE_LOSSES
from oases_jax.models.sharding import abstract_model, param_shardings
from oases_jax.models.transformer import objective
from oases_jax.rules import ShardingRules, entry_axes, outer_axes
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
    """The training objective and its logged parts (`models.transformer.objective`: for an MoE
    model the cross entropy, router losses and dropped fraction; {} for a dense one)."""
    return objective(nnx.merge(graphdef, params), tokens_BL)


def metric_zeros(cfg: ModelConfig) -> dict:
    """Zeros shaped like the train step's per-micro-batch metrics, to accumulate into."""
    names = ("loss",) + (("ce_loss",) + MOE_LOSSES if cfg.moe else ())
    return {k: jnp.zeros((), jnp.float32) for k in names}


def build_step_fns(cfg: ModelConfig, tx: optax.GradientTransformation,
                   parallel: Parallel) -> StepFns:
    """The jitted step, evaluation and optimizer init for `cfg` run as `parallel` says (its
    mesh, rule set and per-layer strategies)."""
    rules, mesh = parallel.rules, parallel.mesh
    graphdef, abstract_params = abstract_model(cfg)
    p_sh = param_shardings(abstract_params, rules, mesh)
    batch_spec = rules.act_spec((None, "batch", None), mesh)
    batch_sh = NamedSharding(mesh, batch_spec)
    value_and_grad = jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, t, cfg.vocab_size),
                                        has_aux=True)

    def grad_fn(p, t):  # ({"loss": objective, **its parts}, gradients)
        (loss, parts), grads = value_and_grad(p, t)
        return {"loss": loss, **parts}, grads

    groups = accumulation_groups(rules, mesh)

    def train_step(state: TrainState, batch_MBL: jax.Array):
        params = state["params"]
        if batch_MBL.shape[0] == 1:
            loss, grads = grad_fn(params, batch_MBL[0])
        elif groups > 1:
            loss, grads = _accumulate_in_groups(grad_fn, params, batch_MBL, groups, rules, mesh,
                                                p_sh, metric_zeros(cfg), cfg.dtype)
        else:
            loss, grads = accumulate(grad_fn, params, batch_MBL, metric_zeros(cfg), cfg.dtype)
            loss, grads = jax.tree.map(lambda x: x / batch_MBL.shape[0], (loss, grads))
        return optimizer_update(tx, state, grads, loss)

    return assemble_step_fns(
        parallel, tx, abstract_params=abstract_params, p_sh=p_sh, batch_sh=batch_sh,
        train_step=train_step,
        evaluate=lambda p, t: _eval_loss(*loss_fn(graphdef, p, t[0], cfg.vocab_size)))


def optimizer_update(tx: optax.GradientTransformation, state: TrainState, grads,
                     metrics: dict) -> tuple[TrainState, dict]:
    """The step's AdamW update of `state` by `grads`, and the metrics with the gradient norm."""
    params = state["params"]
    with jax.named_scope("optimizer"):
        updates, opt_state = tx.update(grads, state["opt_state"], params)
        new_state = {
            "params": optax.apply_updates(params, updates),
            "opt_state": opt_state,
            "step": state["step"] + 1,
            "rng": state["rng"],
        }
        return new_state, {**metrics, "grad_norm": optax.tree.norm(grads)}


def assemble_step_fns(parallel: Parallel, tx: optax.GradientTransformation, *,
                      abstract_params, p_sh, batch_sh: NamedSharding, train_step: Callable,
                      evaluate: Callable) -> StepFns:
    """StepFns of a `train_step(state, batch)` and `evaluate(params, batch)` over parameters
    shaped `abstract_params` and sharded `p_sh` (the plain layout, or a pipeline's stage
    layout): the optimizer state's shardings, the jitted functions traced under `parallel`,
    and the abstract state a checkpoint is restored onto."""
    mesh = parallel.mesh
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
        eval_jit = jax.jit(traced(evaluate), in_shardings=(p_sh, batch_sh),
                           out_shardings=replicated)
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


def accumulation_groups(rules: ShardingRules, mesh: Mesh, data: str = "data") -> int:
    """Into how many data-parallel groups gradient accumulation splits the batch, each group
    summing its own gradients over the micro-batches before one reduction per step: the size
    of the data axis, or 1 where parameters are sharded over it (FSDP reduce-scatters every
    micro-batch's gradients, as ZeRO-3 does, since no device holds a whole gradient) or where
    the batch is not split over `data` first, or over an expert axis too (below)."""
    size = mesh.shape.get(data, 1)
    batch = rules.act_spec(("batch",), mesh)
    split = entry_axes(batch[0] if len(batch) else None)
    if size == 1 or split[:1] != (data,) or "expert" in split:
        # A batch split over `data` first: primepar's (data, tp_row) keeps tp_row inside each
        # group. An MoE batch split over data x expert reduces every micro-batch.
        return 1
    if any(data in entry_axes(axes) for _, axes in rules.params):
        return 1
    return size


def _eval_loss(loss: jax.Array, parts: dict) -> jax.Array:
    """Validation reports the cross entropy (an MoE model's objective adds router losses)."""
    return parts.get("ce_loss", loss)


def accumulate(grad_fn, params, batch_MBL: jax.Array, metric_zeros: dict, dtype):
    """The sums over the M micro-batches of `grad_fn(params, tokens)`'s metrics and gradients,
    the gradients in the parameters' dtype (float32).

    The block weights are cast to the compute dtype once, before the loop, not once per
    micro-batch: the same values and gradients (a cast's transpose is the same cast, and each
    micro-batch's gradient reaches float32 before it is summed), one pass over the weights
    instead of M (9 ms of GPT-2 1.5B's 335 ms step at M=4 on an H100,
    benchmarks/results/accumulation_gpt2-1.5b_h100x1.txt)."""
    cast = compute_weights(params, dtype)

    def micro(acc, tokens_BL):
        return _add(acc, grad_fn(cast, tokens_BL)), None

    zeros = (metric_zeros, jax.tree.map(jnp.zeros_like, params))
    return jax.lax.scan(micro, zeros, batch_MBL)[0]


def _add(acc, g):
    """acc + g in the accumulator's dtype: a micro-batch's gradients reach float32 here."""
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)


def _accumulate_in_groups(grad_fn, params, batch_MBL, groups: int, rules: ShardingRules,
                          mesh: Mesh, p_sh, metric_zeros: dict, dtype):
    """Mean loss and gradients over M micro-batches, reduced over the data axis once.

    A plain scan of `grad_fn` gives each micro-batch's gradients the parameters' (replicated)
    sharding, so the partitioner all-reduces them inside the loop: M all-reduces per step.
    Here the loop runs inside a `shard_map` manual over `data` only (`tensor` and the others
    stay with the partitioner and the model's own shard_maps, which nest inside): each data
    group sums its own gradients over the micro-batches, and one psum after the loop is the
    step's reduction. Specs inside leave `data` out (`rules.outer_axes`)."""
    m = batch_MBL.shape[0]

    def local(params, tokens_MBL):
        with outer_axes("data"):
            total = accumulate(grad_fn, params, tokens_MBL, metric_zeros, dtype)
        return jax.lax.psum(total, "data")

    # No replication checks: the model's shard_maps nest inside, which JAX only lowers without
    # them (jax 0.12: a nested shard_map's residuals otherwise name the outer manual axis).
    loss, grads = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(None, "data")),
                                out_specs=P(), axis_names={"data"}, check_vma=False
                                )(params, batch_MBL)
    # Every group holds the same number of rows of every micro-batch: the step's mean is the
    # mean of the groups' means.
    return jax.tree.map(lambda x: x / (groups * m), (loss, grads))


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
