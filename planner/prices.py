"""Prices of single operations on one cluster: a GEMM, a memory-bound pass, a collective over a
group of devices; datasheet numbers, overridden by a calibration profile where it has them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from oases_jax.analysis.hardware import ClusterSpec
from oases_jax.analysis.simulate import collective_time
from planner.profile import Profile


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Prices for one cluster: datasheet numbers, overridden by a calibration profile where it
    has them (`planner.profile.Profile`)."""

    cluster: ClusterSpec
    profile: Profile | None = None
    async_collectives: bool = True

    @classmethod
    def of(cls, cluster: ClusterSpec, profile: Profile | None = None) -> Hardware:
        # CPU collectives are synchronous: nothing overlaps there.
        return cls(cluster, profile, async_collectives=cluster.device != "cpu")

    def gemm_s(self, flops: float, nbytes: float, dtype: str, chunks: int = 1) -> float:
        """One GEMM split into `chunks` calls: the profile's fit if it has this dtype, else
        max(flops / peak, bytes / HBM)."""
        if self.profile is not None:
            t = self.profile.gemm_time(flops, dtype, chunks)
            if t is not None:
                return t
        dev = self.cluster.device_spec
        return max(flops / dev.peak(dtype), nbytes / dev.hbm_bytes_per_s)

    def mem_s(self, nbytes: float) -> float:
        """A memory-bound (elementwise, reduction) op: bytes / the profile's measured
        bandwidth of fused normalisation passes if it has one, else / HBM bandwidth."""
        if self.profile is not None:
            t = self.profile.mem_time(nbytes)
            if t is not None:
                return t
        return nbytes / self.cluster.device_spec.hbm_bytes_per_s

    def comm_s(self, kind: str, nbytes: float, group: Sequence[int]) -> float:
        """One collective over the device ids `group`: the profile's fit for (kind, size) if
        present, else alpha-beta on the slowest link the group spans."""
        n = len(group)
        if n <= 1 or nbytes <= 0:
            return 0.0
        if self.profile is not None:
            t = self.profile.comm_time(kind, nbytes, n)
            if t is not None:
                return t
        return collective_time(kind, nbytes, n, self.cluster.link_for(group))
