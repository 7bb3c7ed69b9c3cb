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


def manual_axes() -> frozenset[str]:
    """The mesh axes an enclosing `shard_map` has made manual (empty outside one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return frozenset(getattr(mesh, "manual_axes", ()) or ())


def context_mesh(mesh):
    """The mesh a `shard_map` or sharding constraint traced here must name: `mesh` itself,
    except inside an enclosing `shard_map` (a pipeline's stage loop), where JAX wants the
    context's abstract mesh, whose outer axes are already manual."""
    return jax.sharding.get_abstract_mesh() if manual_axes() else mesh
