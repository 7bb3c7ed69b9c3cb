"""Logical axis names and the rule sets that map them onto mesh axes.

Models name every dimension with a word from `LOGICAL_AXES`; a `ShardingRules` object turns such a
tuple into a `PartitionSpec` for a given mesh. Parameter rules and activation rules are kept apart
because FSDP shards parameters over the data axis while activations stay batch-sharded.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from oases_jax import compat
from oases_jax.errors import UserError

# The closed vocabulary of logical dimension names. `None` in a logical tuple means "never sharded".
LOGICAL_AXES = (
    "batch",  # examples in a (micro-)batch
    "seq",  # sequence positions of the residual stream (sequence parallelism shards it)
    "embed",  # model width D
    "heads",  # query heads H
    "kv_heads",  # key/value heads G (grouped-query attention)
    "head_dim",  # per-head width K
    "mlp",  # MLP hidden width F
    "vocab",  # vocabulary V
    "layers",  # stacked layers (scan axis)
    "expert",  # MoE experts E
    "norm",  # norm scales and biases
    "pos",  # learned position table rows
)

Logical = tuple[str | None, ...]
MeshAxes = str | tuple[str, ...] | None
RuleTable = tuple[tuple[str, MeshAxes], ...]


def _check_table(table: RuleTable, what: str) -> None:
    for name, _ in table:
        if name not in LOGICAL_AXES:
            raise UserError(f"{what} rule names unknown logical axis {name!r}; use {LOGICAL_AXES}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingRules:
    """A named pair of rule tables: logical name -> mesh axis (or axes, or None)."""

    name: str
    params: RuleTable
    activations: RuleTable
    description: str = ""

    def __post_init__(self):
        _check_table(self.params, "parameter")
        _check_table(self.activations, "activation")

    def param_spec(self, logical: Logical, mesh: Mesh | None = None) -> PartitionSpec:
        return _to_spec(logical, dict(self.params), mesh)

    def act_spec(self, logical: Logical, mesh: Mesh | None = None) -> PartitionSpec:
        return _to_spec(logical, dict(self.activations), mesh)

    def flax_rules(self, kind: str = "params", mesh: Mesh | None = None
                   ) -> tuple[tuple[str, MeshAxes], ...]:
        """The table as `(logical, mesh_axes)` pairs for `nn.logical_axis_rules` /
        `nnx.logical_axis_rules` in models this project did not write.

        Every logical name is listed (unmapped ones with None), because Flax treats a name absent
        from the rules as a mesh axis. With `mesh` (or the mesh set by `jax.set_mesh`), axes that
        mesh lacks are dropped, as `param_spec` does; with neither, the axes only some meshes have
        (OPTIONAL_AXES: `expert`) are dropped, so the rules fit a plain data x tensor mesh."""
        if kind not in ("params", "activations"):
            raise UserError(f"rule kind {kind!r} is unknown; use 'params' or 'activations'")
        if mesh is None:
            context = jax.sharding.get_abstract_mesh()
            mesh = context if context is not None and context.axis_names else None
        table = dict(self.params if kind == "params" else self.activations)
        out = []
        for name in LOGICAL_AXES:
            axes = table.get(name)
            if axes is not None:
                kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes)
                             if (a in mesh.shape and mesh.shape[a] > 1 if mesh is not None
                                 else a not in OPTIONAL_AXES))
                axes = None if not kept else kept[0] if len(kept) == 1 else kept
            out.append((name, axes))
        return tuple(out)


def _to_spec(logical: Logical, table: dict[str, MeshAxes], mesh: Mesh | None) -> PartitionSpec:
    """Map logical names to a PartitionSpec. Axes absent from `mesh` (or of size 1) are dropped, so
    one rule set serves every mesh; an axis used by two dimensions is an error in the rules."""
    used: set[str] = set()
    taken = _OUTER.get()
    out = []
    for name in logical:
        axes = table.get(name) if name is not None else None
        if axes is None:
            out.append(None)
            continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        if mesh is not None:
            axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1)
        axes = tuple(a for a in axes if a not in taken)
        for a in axes:
            if a in used:
                raise UserError(
                    f"logical axes {logical} map mesh axis {a!r} twice; fix the sharding rules"
                )
            used.add(a)
        out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*out)


def entry_axes(entry: MeshAxes) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _padded(spec: PartitionSpec, ndim: int) -> tuple:
    return tuple(spec) + (None,) * (ndim - len(spec))


def spec_divides(shape: Sequence[int], spec: PartitionSpec, mesh: Mesh) -> int | None:
    """Index of the first dimension of `shape` not divisible by its mesh axes, or None."""
    for i, (dim, axes) in enumerate(zip(shape, _padded(spec, len(shape)), strict=True)):
        if axes is None:
            continue
        axes = (axes,) if isinstance(axes, str) else axes
        if dim % math.prod(mesh.shape[a] for a in axes):
            return i
    return None


# Rule sets. Each is a function of the mesh axis names so users can rename axes.


def data_parallel(*, data: str = "data", expert: str = "expert") -> ShardingRules:
    return ShardingRules(
        name="dp",
        description="data parallel: parameters replicated, batch split over the data axis",
        params=(("expert", expert),),
        activations=(("batch", (data, expert)),),
    )


def fsdp(*, data: str = "data") -> ShardingRules:
    return ShardingRules(
        name="fsdp",
        description="ZeRO-3: parameters, gradients and optimizer state sharded over the data axis",
        params=(("embed", data),),
        activations=(("batch", data),),
    )


_TP_PARAMS = (("heads", "{t}"), ("kv_heads", "{t}"), ("mlp", "{t}"), ("vocab", "{t}"))


def _tp_params(tensor: str) -> RuleTable:
    return tuple((name, axis.format(t=tensor)) for name, axis in _TP_PARAMS)


# MoE (dp, tp, tp_sp): experts split over `expert`, which also splits the batch (expert
# parallelism is data parallelism for everything but the experts; docs/parallelism.md).


def megatron(*, data: str = "data", tensor: str = "tensor", expert: str = "expert"
             ) -> ShardingRules:
    return ShardingRules(
        name="tp",
        description="Megatron tensor parallel: heads, MLP and vocab split over the tensor axis",
        params=_tp_params(tensor) + (("expert", expert),),
        activations=(("batch", (data, expert)),) + _tp_params(tensor),
    )


def megatron_sp(*, data: str = "data", tensor: str = "tensor", expert: str = "expert"
                ) -> ShardingRules:
    return ShardingRules(
        name="tp_sp",
        description="Megatron tensor + sequence parallel: the residual stream is split on seq",
        params=_tp_params(tensor) + (("expert", expert),),
        activations=(("batch", (data, expert)), ("seq", tensor)) + _tp_params(tensor),
    )


def fsdp_tp(*, data: str = "data", tensor: str = "tensor") -> ShardingRules:
    return ShardingRules(
        name="fsdp_tp",
        description="FSDP over the data axis combined with Megatron tensor parallel",
        params=(("embed", data),) + _tp_params(tensor),
        activations=(("batch", data),) + _tp_params(tensor),
    )


def primepar(*, data: str = "data", rows: str = "tp_row", cols: str = "tp_col") -> ShardingRules:
    """PrimePar on the rows x cols square: weights split over both axes (no replication), the
    batch over data and rows, activations' features over cols (docs/parallelism.md)."""
    split = (("heads", cols), ("kv_heads", cols), ("mlp", cols), ("vocab", cols))
    return ShardingRules(
        name="primepar",
        description="PrimePar: weights split over a square of devices, activations not replicated",
        params=(("embed", rows), ("norm", cols)) + split,  # norms: as the activations' D
        activations=(("batch", (data, rows)), ("embed", cols)) + split,
    )


RULE_SETS: dict[str, Callable[..., ShardingRules]] = {
    "dp": data_parallel,
    "fsdp": fsdp,
    "tp": megatron,
    "tp_sp": megatron_sp,
    "fsdp_tp": fsdp_tp,
    "primepar": primepar,
}


def get_rules(name: str) -> ShardingRules:
    if name not in RULE_SETS:
        raise UserError(f"unknown rule set {name!r}; choose one of {', '.join(RULE_SETS)}")
    return RULE_SETS[name]()


# Mesh axes the built-in rule sets name that only some meshes have: `flax_rules` without a mesh
# leaves them out.
OPTIONAL_AXES = ("expert",)


# Mesh axes an enclosing transformation already splits: a `vmap(..., spmd_axis_name=...)` over
# groups of the batch (gradient accumulation with one data-parallel reduction per step) or a
# `shard_map` manual over them (a pipeline's stage loop). Specs built inside leave them out; the
# enclosing transformation places its own dimension on them.

_OUTER: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "oases_jax_outer_axes", default=frozenset()
)


@contextlib.contextmanager
def outer_axes(*axes: str):
    """Build every spec inside this block without `axes` (see `_OUTER`)."""
    token = _OUTER.set(_OUTER.get() | frozenset(axes))
    try:
        yield
    finally:
        _OUTER.reset(token)


# Activation constraints: models call `constrain(x, names)`; it is a no-op outside `use_rules`.

_ACTIVE: contextvars.ContextVar[tuple[ShardingRules, Mesh] | None] = contextvars.ContextVar(
    "oases_jax_rules", default=None
)


@contextlib.contextmanager
def use_rules(rules: ShardingRules, mesh: Mesh):
    """Activate `rules` on `mesh` for `constrain` calls traced inside this block."""
    token = _ACTIVE.set((rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@contextlib.contextmanager
def suspend_rules():
    """No activation constraints inside (e.g. code traced per device inside shard_map)."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active_rules() -> tuple[ShardingRules, Mesh] | None:
    return _ACTIVE.get()


def constrain(x: jax.Array, logical: Logical) -> jax.Array:
    """`with_sharding_constraint` by logical names under the active rules (identity if none)."""
    active = _ACTIVE.get()
    if active is None:
        return x
    rules, mesh = active
    if len(logical) != x.ndim:
        raise ValueError(f"constrain: logical axes {logical} do not match shape {x.shape}")
    spec = rules.act_spec(logical, mesh)
    if spec_divides(x.shape, spec, mesh) is not None:
        return x  # e.g. a batch of 1 on a data axis of 2: leave it to the partitioner
    return jax.lax.with_sharding_constraint(x, NamedSharding(compat.context_mesh(mesh), spec))
