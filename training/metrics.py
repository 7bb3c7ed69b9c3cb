"""Throughput, model FLOP/s, MFU, and the JSONL metrics file."""

from __future__ import annotations

import json
import pathlib

import jax

from oases_jax import hardware
from oases_jax.models.config import ModelConfig


def peak_flops_per_device(dtype: str, peak_tflops: float | None) -> float | None:
    """Per-device peak FLOP/s: the flag if given, else the datasheet of the detected accelerator.
    None for CPUs, whose hardware-table entry is a planning figure rather than a peak."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    device = jax.devices()[0]
    spec = None if device.platform == "cpu" else hardware.detect(device.device_kind)
    return spec.peak(dtype) if spec and dtype in spec.peak_flops else None


def throughput(
    cfg: ModelConfig,
    *,
    tokens: int,
    seconds: float,
    seq_len: int,
    n_devices: int,
    peak: float | None,
) -> dict:
    tokens_per_s = tokens / seconds
    flops_per_device = cfg.flops_per_token(seq_len) * tokens_per_s / n_devices
    return {
        "tokens_per_s": tokens_per_s,
        "tflops_per_device": flops_per_device / 1e12,
        "mfu": flops_per_device / peak if peak else None,
    }


class MetricsWriter:
    """Appends one JSON object per line; only process 0 writes."""

    def __init__(self, path: str | None):
        self.file = None
        if path and jax.process_index() == 0:
            p = pathlib.Path(path)
            p.parent.mkdir(parents=True, exist_ok=True)
            self.file = p.open("a")

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()
