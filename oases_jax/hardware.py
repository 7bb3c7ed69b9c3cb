"""Hardware numbers in one place: per-device peaks and memory, shared by metrics, the HLO
simulator and the planner."""

from __future__ import annotations

import dataclasses

from oases_jax.errors import UserError


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator's datasheet numbers (dense, no sparsity)."""

    name: str
    match: tuple[str, ...]  # substrings of `jax.Device.device_kind` that identify it
    peak_flops: dict[str, float]  # by compute dtype
    hbm_bytes_per_s: float
    memory_bytes: float

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise UserError(
                f"no peak FLOP/s for dtype {dtype!r} on {self.name}; pass --peak-tflops"
            )
        return self.peak_flops[dtype]


_T = 1e12
_G = 1e9
DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec(
            name="h100",
            match=("H100",),
            hbm_bytes_per_s=3.35e12,
            memory_bytes=80 * 2**30,
            peak_flops={"bfloat16": 989 * _T, "float32": 494 * _T},
        ),  # fp32 via TF32
        DeviceSpec(
            name="h200",
            match=("H200",),
            hbm_bytes_per_s=4.8e12,
            memory_bytes=141 * _G,
            peak_flops={"bfloat16": 989 * _T, "float32": 494 * _T},
        ),
        DeviceSpec(
            name="a100",
            match=("A100",),
            hbm_bytes_per_s=2.04e12,
            memory_bytes=80 * 2**30,
            peak_flops={"bfloat16": 312 * _T, "float32": 156 * _T},
        ),
        DeviceSpec(
            name="v100",
            match=("V100",),
            hbm_bytes_per_s=0.9e12,
            memory_bytes=32 * 2**30,
            peak_flops={"bfloat16": 125 * _T, "float32": 15.7 * _T},
        ),  # bf16 row: fp16
        DeviceSpec(
            name="3090",
            match=("3090",),
            hbm_bytes_per_s=0.936e12,
            memory_bytes=24 * 2**30,
            peak_flops={"bfloat16": 71 * _T, "float32": 35.6 * _T},
        ),
    )
}


def device_spec(name: str) -> DeviceSpec:
    if name not in DEVICES:
        raise UserError(f"unknown device {name!r}; known: {', '.join(DEVICES)}")
    return DEVICES[name]


def detect(device_kind: str) -> DeviceSpec | None:
    """The spec whose `match` appears in a device kind string, e.g. 'NVIDIA H100 80GB HBM3'."""
    for spec in DEVICES.values():
        if any(m.lower() in device_kind.lower() for m in spec.match):
            return spec
    return None
