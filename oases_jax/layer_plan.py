"""Per-layer strategies: one record (`LayerSpec`) says how one transformer layer runs, its
schedule, sub-batch count and remat policy. The planner prices them, plans store them, and the
runtime runs each run of equal consecutive layers (`segments`) as one segment."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from oases_jax import registry
from oases_jax.errors import UserError
from oases_jax.remat import POLICIES as REMATS


@dataclasses.dataclass(frozen=True, kw_only=True, order=True)
class LayerSpec:
    """One layer's schedule (a `registry` name), its sub-batch count and its remat policy."""

    schedule: str = "megatron"
    sub_batches: int = 1
    remat: str = "none"

    def __post_init__(self):
        registry.get(self.schedule)
        if self.sub_batches < 1:
            raise UserError(f"layer sub_batches={self.sub_batches} must be >= 1")
        if self.remat not in REMATS:
            raise UserError(f"unknown remat {self.remat!r}; choose one of {', '.join(REMATS)}")

    @property
    def spec(self) -> registry.ScheduleSpec:
        return registry.get(self.schedule)

    def label(self) -> str:
        sb = f"/{self.sub_batches}" if self.spec.sub_batches else ""
        return f"{self.schedule}{sb}+{self.remat}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def segments(layers: Sequence[LayerSpec]) -> list[tuple[int, int, LayerSpec]]:
    """Runs of equal consecutive entries as (start, end, spec), end exclusive."""
    out: list[tuple[int, int, LayerSpec]] = []
    for i, spec in enumerate(layers):
        if out and out[-1][2] == spec:
            out[-1] = (out[-1][0], i + 1, spec)
        else:
            out.append((i, i + 1, spec))
    return out
