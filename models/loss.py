"""Next-token cross entropy over a large vocabulary, with a hand-written backward.

Left to autodiff, the loss of bf16 logits [B, L, V] casts them to float32 and differentiates
`logsumexp` and `take_along_axis`: the backward writes float32 softmax probabilities, scatters
the targets' -1 into them and casts the result back to bf16 for the head's GEMMs. At GPT-2's
50k vocabulary and 8 x 1024 tokens that is four float32 passes of 1.6 GB each. The backward
here is one elementwise pass, (softmax - onehot) * g / N from the logits in their own dtype and
the saved log-partition, with the onehot an iota compare instead of a scatter. Values are the
same as autodiff's up to float32 rounding (the statistics and the difference are float32; the
cotangent takes the logits' dtype, which is what the head's GEMMs were given before too).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from oases_jax import compat
from oases_jax.rules import active_rules, entry_axes


def _masked(logits_BLV: jax.Array, ids_V: jax.Array, vocab_size: int) -> jax.Array:
    """float32 logits with the padded vocabulary rows (ids >= vocab_size) at the float32
    minimum; `ids_V` are the vocabulary ids of the logits' last axis."""
    return jnp.where(ids_V < vocab_size, logits_BLV.astype(jnp.float32),
                     jnp.finfo(jnp.float32).min)


def _vocab_beside_batch_in_manual_region() -> bool:
    """Inside a region manual over some mesh axes, whether the active rules split the logits'
    vocabulary beside their batch over mesh axes the region leaves to the partitioner (as
    fsdp_tp's and PrimePar's rules do inside a pipeline's stage loop), where XLA's partitioner
    aborts on the target's gather. The vocabulary split alone (tp's rules) partitions."""
    manual = compat.manual_axes()
    active = active_rules()
    if not manual or active is None:
        return False
    rules, mesh = active
    spec = rules.act_spec(("batch", None, "vocab"), mesh)

    def split(entry) -> bool:
        return any(a not in manual and mesh.shape[a] > 1 for a in entry_axes(entry))

    return split(spec[-1]) and any(split(e) for e in spec[:-1])


def _target(x_BLV: jax.Array, ids_V: jax.Array, targets_BL: jax.Array) -> jax.Array:
    """The target's logit among the ids `ids_V` (0 where it is not one of them): a masked sum
    over V, no gather."""
    return jnp.sum(jnp.where(ids_V == targets_BL[..., None], x_BLV, 0.0), axis=-1)


def _logits_grad(logits_BLV, targets_BL, ids_V, vocab_size, logz_BL, g):
    """The loss's gradient on logits of the ids `ids_V`: (softmax - onehot) * g / N, in the
    logits' dtype, from the saved log-partition."""
    with jax.named_scope("loss"):
        p_BLV = jnp.exp(_masked(logits_BLV, ids_V, vocab_size) - logz_BL[..., None])
        onehot_BLV = ids_V == targets_BL[..., None]
        scale = g / targets_BL.size
        return ((p_BLV - onehot_BLV) * scale).astype(logits_BLV.dtype)


def _forward(logits_BLV, targets_BL, vocab_size):
    ids_V = jnp.arange(logits_BLV.shape[-1])
    x_BLV = _masked(logits_BLV, ids_V, vocab_size)
    logz_BL = jax.nn.logsumexp(x_BLV, axis=-1)
    if _vocab_beside_batch_in_manual_region():
        # Inside a region manual over some mesh axes (a pipeline's stage loop), XLA's SPMD
        # partitioner aborts on the gather below when the logits are split over the
        # vocabulary beside other axes (spmd_partitioner_util.cc:498): a masked sum instead.
        # Only there: in every manual region it cost the tick executor's GPipe on GPT-2 1.5B
        # (h100:16, stage=2,data=8, M=4) 219.9 -> 246.0 ms, its pools copied in every branch,
        # and where only the vocabulary is split (tp, data=2,stage=2,tensor=4) interleaved's
        # two-tick backward 285.9 -> 585.2 ms.
        target_BL = _target(x_BLV, ids_V, targets_BL)
    else:
        target_BL = jnp.take_along_axis(x_BLV, targets_BL[..., None], axis=-1)[..., 0]
    return jnp.mean(logz_BL - target_BL), logz_BL


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _cross_entropy(logits_BLV, targets_BL, vocab_size):
    return _forward(logits_BLV, targets_BL, vocab_size)[0]


def _fwd(logits_BLV, targets_BL, vocab_size):
    loss, logz_BL = _forward(logits_BLV, targets_BL, vocab_size)
    return loss, (logits_BLV, targets_BL, logz_BL)


def _bwd(vocab_size, res, g):
    logits_BLV, targets_BL, logz_BL = res
    d_BLV = _logits_grad(logits_BLV, targets_BL, jnp.arange(logits_BLV.shape[-1]), vocab_size,
                         logz_BL, g)
    targets_ct = jnp.zeros(targets_BL.shape, jax.dtypes.float0)
    return d_BLV, targets_ct


_cross_entropy.defvjp(_fwd, _bwd)


@jax.named_scope("loss")
def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array, vocab_size: int) -> jax.Array:
    """Mean next-token cross entropy of logits [B, L, V] (any float dtype; the statistics are
    float32) against integer targets [B, L]; padded vocabulary rows (index >= vocab_size) are
    masked out of the softmax."""
    return _cross_entropy(logits_BLV, targets_BL, vocab_size)


def _split_forward(logits_BLV, targets_BL, ids_V, vocab_size, axis):
    x_BLV = _masked(logits_BLV, ids_V, vocab_size)
    # The shift is a constant of the log-sum-exp (its gradient cancels), so no gradient is
    # taken through the maximum.
    max_BL = jax.lax.pmax(jnp.max(x_BLV, axis=-1), axis)
    sum_BL = jax.lax.psum(jnp.sum(jnp.exp(x_BLV - max_BL[..., None]), axis=-1), axis)
    logz_BL = jnp.log(sum_BL) + max_BL
    target_BL = jax.lax.psum(_target(x_BLV, ids_V, targets_BL), axis)
    return jnp.mean(logz_BL - target_BL), logz_BL


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _split_cross_entropy(logits_BLV, targets_BL, ids_V, vocab_size, axis):
    return _split_forward(logits_BLV, targets_BL, ids_V, vocab_size, axis)[0]


def _split_fwd(logits_BLV, targets_BL, ids_V, vocab_size, axis):
    loss, logz_BL = _split_forward(logits_BLV, targets_BL, ids_V, vocab_size, axis)
    return loss, (logits_BLV, targets_BL, ids_V, logz_BL)


def _split_bwd(vocab_size, axis, res, g):
    logits_BLV, targets_BL, ids_V, logz_BL = res
    d_BLV = _logits_grad(logits_BLV, targets_BL, ids_V, vocab_size, logz_BL, g)
    zeros = jnp.zeros(targets_BL.shape, jax.dtypes.float0)
    return d_BLV, zeros, jnp.zeros(ids_V.shape, jax.dtypes.float0)


_split_cross_entropy.defvjp(_split_fwd, _split_bwd)


@jax.named_scope("loss")
def split_cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array, ids_V: jax.Array,
                        vocab_size: int, axis: str) -> jax.Array:
    """`cross_entropy` with the vocabulary split over the devices of the manual mesh axis
    `axis`: each device holds the logits [B, L, V/n] of the vocabulary ids `ids_V` [V/n] (any
    subset; ids >= vocab_size are padding), and the log-partition and the target's logit are
    summed over `axis` (a maximum, a sum and a sum of B x L floats). Every device gets the same
    mean loss; the backward is local, (softmax - onehot) * g / N on the device's own ids."""
    return _split_cross_entropy(logits_BLV, targets_BL, ids_V, vocab_size, axis)
