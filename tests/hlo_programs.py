"""Small shard_map programs that more than one HLO test compiles."""

import jax
import jax.numpy as jnp


def ppermute_ring_matmul(x_blk, w_blk, n=8):
    """All-gather matmul as a fori_loop ring over `tensor`: x row blocks travel around the ring,
    each multiplied as it arrives, so each step's GEMM can overlap the next block's permute."""
    idx = jax.lax.axis_index("tensor")
    perm = [(i, (i + 1) % n) for i in range(n)]

    def body(i, carry):
        x, acc = carry
        nxt = jax.lax.ppermute(x, "tensor", perm)
        acc = jax.lax.dynamic_update_slice_in_dim(acc, x @ w_blk, ((idx - i) % n) * x.shape[0], 0)
        return nxt, acc

    acc = jax.lax.pcast(jnp.zeros((x_blk.shape[0] * n, w_blk.shape[1]), x_blk.dtype),
                        ("tensor",), to="varying")
    return jax.lax.fori_loop(0, n, body, (x_blk, acc))[1]
