"""Per-layer strategies: a plan gives each transformer layer its own tensor-parallel schedule,
sub-batch count and remat policy. Models read the active plan (`active()`) and run each run of
equal consecutive layers (`segments`) as one scan under that segment's schedule and rules; the
residual stream is resharded at the segment boundaries."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence

from oases_jax.rules import ShardingRules, get_rules

SEQUENCE_PARALLEL = ("megatron_sp", "collective_matmul", "oases_cm", "xla_auto")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSpec:
    schedule: str = "megatron"
    sub_batches: int = 1
    remat: str = "none"


_ACTIVE: contextvars.ContextVar[tuple[LayerSpec, ...] | None] = contextvars.ContextVar(
    "oases_jax_layer_plan", default=None)


def active() -> tuple[LayerSpec, ...] | None:
    return _ACTIVE.get()


@contextlib.contextmanager
def use_layer_plan(layers: Sequence[LayerSpec] | None):
    token = _ACTIVE.set(tuple(layers) if layers is not None else None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def segments(layers: Sequence[LayerSpec]) -> list[tuple[int, int, LayerSpec]]:
    """Runs of equal consecutive entries as (start, end, spec), end exclusive."""
    out: list[tuple[int, int, LayerSpec]] = []
    for i, spec in enumerate(layers):
        if out and out[-1][2] == spec:
            out[-1] = (out[-1][0], i + 1, spec)
        else:
            out.append((i, i + 1, spec))
    return out


def rules_for(schedule: str, base: ShardingRules) -> ShardingRules:
    """The rule set a layer of `schedule` runs under, given the model's: sequence-parallel
    schedules shard the residual stream on `seq` (tp -> tp_sp), the others do not."""
    if schedule in SEQUENCE_PARALLEL and base.name == "tp":
        return get_rules("tp_sp")
    if schedule not in SEQUENCE_PARALLEL and base.name == "tp_sp":
        return get_rules("tp")
    return base
