"""Mesh specs: parse `data=2,tensor=4`, fill one -1 from the device count, and build the mesh."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from oases_jax.errors import UserError

# Mesh axis names the project understands. Rules map logical names onto these.
# `tp_row` x `tp_col` is the square of devices of the primepar schedule.
KNOWN_AXES = ("data", "fsdp", "stage", "expert", "tensor", "tp_row", "tp_col")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MeshSpec:
    """An ordered mesh: ((name, size), ...), with at most one size of -1 (filled later)."""

    axes: tuple[tuple[str, int], ...]

    def __post_init__(self):
        if not self.axes:
            raise UserError("mesh is empty; give at least one axis, e.g. --mesh data=-1")
        names = [n for n, _ in self.axes]
        for name in names:
            if name not in KNOWN_AXES:
                raise UserError(
                    f"unknown mesh axis {name!r}; use axes from {', '.join(KNOWN_AXES)}"
                )
        if len(set(names)) != len(names):
            raise UserError(f"mesh axis repeated in {self}; name each axis once")
        sizes = [s for _, s in self.axes]
        if sizes.count(-1) > 1:
            raise UserError(f"mesh {self} has more than one -1; at most one axis may be inferred")
        for name, size in self.axes:
            if size == 0 or size < -1:
                raise UserError(f"mesh axis {name}={size} is invalid; sizes are positive or -1")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n, _ in self.axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    def size(self, name: str) -> int:
        return dict(self.axes).get(name, 1)

    def resolve(self, num_devices: int) -> MeshSpec:
        """Fill the -1 axis so that the product equals `num_devices`; check the product."""
        known = math.prod(s for s in self.shape if s != -1)
        axes = self.axes
        if -1 in self.shape:
            if num_devices % known:
                raise UserError(
                    f"mesh {self} cannot be filled: {num_devices} devices are not divisible by "
                    f"{known}; choose sizes whose product divides {num_devices}"
                )
            axes = tuple((n, num_devices // known if s == -1 else s) for n, s in axes)
        resolved = MeshSpec(axes=axes)
        if math.prod(resolved.shape) != num_devices:
            raise UserError(
                f"mesh {self} needs {math.prod(resolved.shape)} devices but {num_devices} are "
                f"available; make the sizes multiply to {num_devices} or use -1 for one axis"
            )
        return resolved

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in self.axes)


def parse_mesh(text: str) -> MeshSpec:
    """Parse `name=size,name=size` (order kept) into a MeshSpec."""
    axes = []
    for part in text.split(","):
        part = part.strip()
        name, sep, size = part.partition("=")
        if not sep or not name:
            raise UserError(
                f"mesh entry {part!r} in {text!r} is not name=size; e.g. data=2,tensor=4"
            )
        try:
            axes.append((name.strip(), int(size)))
        except ValueError:
            raise UserError(
                f"mesh size {size!r} for axis {name!r} is not an integer; e.g. {name}=2"
            ) from None
    return MeshSpec(axes=tuple(axes))


def make_mesh(spec: MeshSpec | str, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """Build a Mesh with Auto axes (GSPMD propagates shardings between annotations)."""
    if isinstance(spec, str):
        spec = parse_mesh(spec)
    devices = list(jax.devices() if devices is None else devices)
    spec = spec.resolve(len(devices))
    if devices == list(jax.devices()):
        return jax.make_mesh(spec.shape, spec.names, axis_types=(AxisType.Auto,) * len(spec.shape))
    grid = np.asarray(devices, dtype=object).reshape(spec.shape)
    return Mesh(grid, spec.names, axis_types=(AxisType.Auto,) * len(spec.shape))
