"""Prices of single operations on one cluster: a GEMM, a memory-bound pass, a collective over a
group of devices; the datasheet's (`oases_jax.hardware.Prices`), overridden by a calibration
profile where it has them."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Sequence

from oases_jax.hardware import ClusterSpec, LinkSpec, Prices
from oases_jax.planner.calibration.profile import Profile

# XLA's GPU compiler schedules a program against (0.8 M - io) x 0.95 of a device's memory M,
# io being the program's non-aliased inputs and outputs (`GetSchedulerMemoryLimit`: 80% of the
# device memory, less io, less `xla_gpu_memory_limit_slop_factor`'s 5%); a program above it is
# rematerialised where XLA can and its collectives serialised where it cannot (Llama-2 70B on
# h100:32 at 72.9 GiB: "Can't reduce memory use below 61.33GiB", 718 of its 1623 tensor
# all-reduces synchronous). Counting io inside the peak: 0.76 M + 0.05 io; plans keep to 0.76 M.
XLA_SCHEDULER_SHARE = 0.8 * 0.95


@dataclasses.dataclass(frozen=True)
class SharedCores:
    """Devices that are threads of one host sharing its cores (the virtual CPU devices): a cost
    measured with all `devices` busy at once (a calibration profile's, every device timed
    together) runs faster when fewer are busy, each device using up to `per_device` cores. On
    this project's 2-core machine, 20 chained 256 x 256 GEMMs under `lax.cond` on 8, 4, 2 and 1
    of the 8 devices took 14.75, 7.51, 4.62 and 2.89 ms: the idle devices' share goes to the busy
    ones, so a pipeline's bubble costs little there (docs/planner.md, "Ranking on the CPU
    devices")."""

    devices: int
    cores: float
    per_device: float = 1.0

    def tick(self, work: Sequence[float], groups: int) -> float:
        """How long `work` takes (per group of devices/groups devices, each entry at all-busy
        speed) when the groups with work left share the cores (processor sharing)."""
        d = max(self.devices // groups, 1)
        base = min(self.per_device, self.cores / self.devices)  # cores a device gets when all run
        left = sorted(w * base for w in work if w > 0)  # core-seconds per device
        total, done = 0.0, 0.0
        for i, w in enumerate(left):
            speed = min(self.per_device, self.cores / ((len(left) - i) * d))
            total += (w - done) / speed
            done = w
        return total


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Prices for one cluster: datasheet numbers, overridden by a calibration profile where it
    has them (`planner.calibration.profile.Profile`)."""

    cluster: ClusterSpec
    profile: Profile | None = None
    async_collectives: bool = True

    @classmethod
    def of(cls, cluster: ClusterSpec, profile: Profile | None = None) -> Hardware:
        # CPU collectives are synchronous: nothing overlaps there.
        return cls(cluster, profile, async_collectives=cluster.device != "cpu")

    def shared_cores(self) -> SharedCores | None:
        """CPU devices share their host's cores (`SharedCores`): the profile's `host_cores` when
        it recorded them, else this host's. None on GPUs."""
        if self.cluster.device != "cpu":
            return None
        meta = self.profile.meta if self.profile is not None else {}
        cores = meta.get("host_cores") or len(os.sched_getaffinity(0))
        return SharedCores(self.cluster.n_devices, float(cores))

    def memory_fraction(self, fraction: float | None = None) -> float:
        """The share of a device's memory a plan may use: `fraction` when given; else on GPUs
        XLA_SCHEDULER_SHARE (the memory XLA's GPU scheduler plans within: above it the
        latency-hiding scheduler gives up overlap), on CPUs 0.9."""
        if fraction is not None:
            return fraction
        return 0.9 if self.cluster.device == "cpu" else XLA_SCHEDULER_SHARE

    def memory_budget(self, fraction: float | None = None) -> float:
        """Bytes per device a plan may use (`memory_fraction` of `memory_per_device`: on CPUs
        the host's memory over its devices)."""
        return self.memory_fraction(fraction) * self.cluster.memory_per_device

    @functools.cached_property
    def datasheet(self) -> Prices:
        return Prices(self.cluster.device_spec, async_collectives=self.async_collectives)

    def gemm_s(self, flops: float, nbytes: float, dtype: str, chunks: int = 1) -> float:
        """One GEMM split into `chunks` calls: the profile's fit if it has this dtype, else
        the datasheet's max(flops / peak, bytes / HBM)."""
        if self.profile is not None:
            t = self.profile.gemm_time(flops, dtype, chunks)
            if t is not None:
                return t
        return self.datasheet.gemm_s(flops, nbytes, dtype)

    def mem_s(self, nbytes: float) -> float:
        """A memory-bound (elementwise, reduction) op: bytes / the profile's measured
        bandwidth of fused normalisation passes if it has one, else / HBM bandwidth."""
        if self.profile is not None:
            t = self.profile.mem_time(nbytes)
            if t is not None:
                return t
        return self.datasheet.mem_s(nbytes)

    def collective_s(self, kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
        """One collective over `n` devices crossing `link`: the profile's fit for (kind, size)
        if present, else alpha-beta on the link."""
        if n <= 1 or nbytes <= 0:
            return 0.0
        if self.profile is not None:
            t = self.profile.comm_time(kind, nbytes, n)
            if t is not None:
                return t
        return self.datasheet.collective_s(kind, nbytes, n, link)

    def comm_s(self, kind: str, nbytes: float, group: Sequence[int]) -> float:
        """One collective over the device ids `group`, on the slowest link the group spans
        (`collective_s`)."""
        if len(group) <= 1 or nbytes <= 0:
            return 0.0
        return self.collective_s(kind, nbytes, len(group), self.cluster.link_for(group))
