"""Small shims over JAX APIs that moved between the supported versions (0.11.2 to the newest)."""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset[str]:
    """The manual mesh axes `x` varies over inside `shard_map` (its "vma")."""
    aval = jax.typeof(x)
    if hasattr(aval, "vma"):
        return frozenset(aval.vma)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset()


def reduce_to_match(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """psum `grad` over the axes it varies over but `primal` does not: the cotangent of an
    input replicated over an axis is the sum of the per-device contributions."""
    extra = tuple(sorted(varying_axes(grad) - varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad
