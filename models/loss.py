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


def _masked(logits_BLV: jax.Array, vocab_size: int) -> jax.Array:
    """float32 logits with the padded vocabulary rows at the float32 minimum."""
    valid_V = jnp.arange(logits_BLV.shape[-1]) < vocab_size
    return jnp.where(valid_V, logits_BLV.astype(jnp.float32), jnp.finfo(jnp.float32).min)


def _forward(logits_BLV, targets_BL, vocab_size):
    x_BLV = _masked(logits_BLV, vocab_size)
    logz_BL = jax.nn.logsumexp(x_BLV, axis=-1)
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
    with jax.named_scope("loss"):
        p_BLV = jnp.exp(_masked(logits_BLV, vocab_size) - logz_BL[..., None])
        onehot_BLV = jnp.arange(logits_BLV.shape[-1]) == targets_BL[..., None]
        scale = g / targets_BL.size
        d_BLV = ((p_BLV - onehot_BLV) * scale).astype(logits_BLV.dtype)
    targets_ct = jnp.zeros(targets_BL.shape, jax.dtypes.float0)
    return d_BLV, targets_ct


_cross_entropy.defvjp(_fwd, _bwd)


@jax.named_scope("loss")
def cross_entropy(logits_BLV: jax.Array, targets_BL: jax.Array, vocab_size: int) -> jax.Array:
    """Mean next-token cross entropy of logits [B, L, V] (any float dtype; the statistics are
    float32) against integer targets [B, L]; padded vocabulary rows (index >= vocab_size) are
    masked out of the softmax."""
    return _cross_entropy(logits_BLV, targets_BL, vocab_size)
