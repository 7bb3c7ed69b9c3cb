"""Hardware facts in one table: per device its datasheet peaks, memory and bandwidth and, for
the GPUs XLA compiles for without one present, the device facts its compiler reads
(`oases_jax.targets` turns them into a `GpuTargetConfigProto`); the interconnects and clusters;
the alpha-beta collective prices. Shared by metrics, the simulator, the MoE cost, the planner
and the compile targets."""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Annotated

from pydantic import Field

from oases_jax.errors import UserError
from oases_jax.files import read_json
from oases_jax.schema import (
    MAX_DEVICES,
    Pair,
    Strict,
    Text,
    at_most,
    validate,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator's datasheet numbers (dense, no sparsity)."""

    name: str
    match: tuple[str, ...]  # substrings of `jax.Device.device_kind` that identify it
    peak_flops: dict[str, float]  # by compute dtype
    hbm_bytes_per_s: float  # as the device reports it (XLA's `memory_bandwidth`)
    memory_bytes: float  # as the device reports it (XLA's `device_memory_size`)
    # cuDNN's fused (flash) attention runs here: NVIDIA compute capability 8.0 and newer.
    fused_attention: bool = False

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise UserError(
                f"no peak FLOP/s for dtype {dtype!r} on {self.name}; pass --peak-tflops"
            )
        return self.peak_flops[dtype]


_T = 1e12
_COMMON = {
    "threads_per_block_limit": 1024, "threads_per_warp": 32, "shared_memory_per_block": 49152,
    "threads_per_core_limit": 2048, "block_dim_limit_x": 2147483647, "block_dim_limit_y": 65535,
    "block_dim_limit_z": 65535, "registers_per_core_limit": 65536,
    "registers_per_block_limit": 65536,
}
_HOPPER = {**_COMMON, "compute_capability": (9, 0), "shared_memory_per_core": 233472,
           "shared_memory_per_block_optin": 232448, "core_count": 132, "fpus_per_core": 128,
           "l2_cache_size": 52428800, "clock_rate_ghz": 1.98}
DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        DeviceSpec(
            name="h100",
            match=("H100",),
            hbm_bytes_per_s=3352320000000,
            memory_bytes=84942979072,
            peak_flops={"bfloat16": 989 * _T, "float32": 494 * _T},  # fp32 via TF32
            fused_attention=True,
        ),
        DeviceSpec(
            name="h200",
            match=("H200",),
            hbm_bytes_per_s=4.8e12,
            memory_bytes=150754820096,
            peak_flops={"bfloat16": 989 * _T, "float32": 494 * _T},
            fused_attention=True,
        ),
        DeviceSpec(
            name="a100",
            match=("A100",),
            hbm_bytes_per_s=2039000000000,
            memory_bytes=85899345920,
            peak_flops={"bfloat16": 312 * _T, "float32": 156 * _T},
            fused_attention=True,
        ),
        DeviceSpec(
            name="v100",
            match=("V100",),
            hbm_bytes_per_s=0.9e12,
            memory_bytes=32 * 2**30,
            peak_flops={"bfloat16": 125 * _T, "float32": 15.7 * _T},
        ),  # bf16 row: fp16
        # GA102: 936 GB/s GDDR6X, 24 GiB.
        DeviceSpec(
            name="3090",
            match=("3090",),
            hbm_bytes_per_s=0.936e12,
            memory_bytes=24 * 2**30,
            peak_flops={"bfloat16": 71 * _T, "float32": 35.6 * _T},
            fused_attention=True,
        ),
    )
}


# The rest of the facts XLA's GPU compiler reads for the GPUs programs compile for without one
# present (`description`, `compute_capability` and stream_executor's GpuDeviceInfo fields);
# their memory size and bandwidth are the `DEVICES` entry's (`oases_jax.targets`).
COMPILE_FACTS: dict[str, dict] = {
    "h100": {**_HOPPER, "description": "NVIDIA H100 80GB HBM3"},
    "h200": {**_HOPPER, "description": "NVIDIA H200"},
    "a100": {**_COMMON, "description": "NVIDIA A100-SXM4-80GB", "compute_capability": (8, 0),
             "shared_memory_per_core": 167936, "shared_memory_per_block_optin": 166912,
             "core_count": 108, "fpus_per_core": 64, "l2_cache_size": 41943040,
             "clock_rate_ghz": 1.41},
    # GA102 (NVIDIA's Ampere GA102 whitepaper): 82 SMs of 128 FP32 lanes, 100 KiB shared memory
    # per SM (99 KiB per block), 1536 threads per SM, 6 MiB L2.
    "3090": {**_COMMON, "description": "NVIDIA GeForce RTX 3090", "compute_capability": (8, 6),
             "threads_per_core_limit": 1536, "shared_memory_per_core": 102400,
             "shared_memory_per_block_optin": 101376, "core_count": 82, "fpus_per_core": 128,
             "l2_cache_size": 6291456, "clock_rate_ghz": 1.695},
}


def compile_targets() -> tuple[str, ...]:
    """The GPUs programs compile for without one present (those with `COMPILE_FACTS`)."""
    return tuple(COMPILE_FACTS)


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


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkSpec:
    """One level of interconnect: per-GPU bandwidth (bytes/s, one direction) and latency (s)."""

    name: str
    bytes_per_s: float
    latency_s: float


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """Devices plus interconnect levels. `levels` is ((span, link), ...) with growing spans: a
    collective whose devices all lie in one aligned block of `span` devices uses that level's link
    (e.g. ((8, NVLink), (32, InfiniBand)) for 4 nodes of 8 GPUs)."""

    name: str
    device: str
    n_devices: int
    levels: tuple[tuple[int, LinkSpec], ...]

    def __post_init__(self):
        spans = [s for s, _ in self.levels]
        if not spans or spans != sorted(spans) or spans[-1] < self.n_devices:
            raise UserError(f"cluster {self.name}: the spans {spans} of its levels must grow "
                            f"and reach n_devices={self.n_devices}")

    @property
    def device_spec(self) -> DeviceSpec:
        return device_spec(self.device)

    @property
    def memory_per_device(self) -> float:
        """Bytes of memory each device has to itself: its datasheet's, except on CPUs, whose
        virtual devices share one host's memory (8 devices of a 24 GiB host: 3 GiB each)."""
        mem = self.device_spec.memory_bytes
        return mem / self.n_devices if self.device == "cpu" else mem

    @property
    def devices_per_node(self) -> int:
        """Devices sharing the fastest level that is not the network (the first level)."""
        return self.levels[0][0] if len(self.levels) > 1 else self.n_devices

    def link_for(self, devices) -> LinkSpec:
        """The slowest link a group of device ids must cross: a level's link is crossed when
        two of the devices share one of its blocks (`span` devices) but not a block of the level
        below (so a ring through them passes over it). Usually the outermost level the group
        spans; not where an inner link is the slower one (PCIe staged through host memory
        inside servers joined by InfiniBand: a ring over two such servers is as slow as PCIe)."""
        devices = sorted(set(devices))
        crossed, inner = [], 1
        for span, link in self.levels:
            blocks: dict[int, set[int]] = {}
            for d in devices:
                blocks.setdefault(d // span, set()).add(d // inner)
            if any(len(b) > 1 for b in blocks.values()):
                crossed.append(link)
            inner = span
        if not crossed:
            return self.levels[0][1]
        return min(crossed, key=lambda link: link.bytes_per_s)

    def to_json(self) -> dict:
        """The cluster and its device's datasheet (`device_spec`), so that a copy can describe
        a device this module does not know; JSON's types (lists, not tuples)."""
        spec = dataclasses.asdict(self.device_spec)
        return {**dataclasses.asdict(self), "levels": [[s, dataclasses.asdict(link)]
                                                       for s, link in self.levels],
                "device_spec": {**spec, "match": list(spec["match"])}}

    @classmethod
    def from_json(cls, data: object, where: str = "cluster JSON") -> ClusterSpec:
        """Inverse of `to_json`, validated (`ClusterFile`). A `device_spec` whose name is not
        built in registers that device; `device_spec` may be left out for a built-in device."""
        c = validate(ClusterFile, data, where=where, kind="cluster", fix=CLUSTER_FIX)
        if c.device_spec is not None:
            spec = DeviceSpec(**{**c.device_spec.model_dump(), "match": tuple(c.device_spec.match)})
            if spec.name != c.device:
                raise UserError(f"{where}: device_spec.name {spec.name!r} is not device "
                                f"{c.device!r}; name the same device in both")
            if DEVICES.setdefault(spec.name, spec) != spec:
                raise UserError(f"{where}: device {spec.name!r} is built in with other numbers; "
                                "give your device another name")
        elif c.device not in DEVICES:
            raise UserError(f"{where}: device {c.device!r} is not built in and the file has no "
                            f"device_spec; use one of {', '.join(DEVICES)} or add its datasheet "
                            "as device_spec (docs/inspection.md)")
        levels = tuple((span, LinkSpec(**link.model_dump())) for span, link in c.levels)
        try:
            return cls(name=c.name, device=c.device, n_devices=c.n_devices, levels=levels)
        except UserError as e:
            raise UserError(f"{where}: levels: {e}; {CLUSTER_FIX}") from None


CLUSTER_FIX = ("write one with scripts/plan.py --cluster h100-32 --save-cluster FILE and edit it "
               "(docs/inspection.md)")


# The ranges a cluster file's numbers must lie in: wide enough for any machine that exists or is
# planned (a 1 kB/s link, 10 PB/s of HBM, an exaflop chip), narrow enough that every price is a
# finite number of seconds.
Bandwidth = Annotated[float, Field(ge=1e3, le=1e16)]  # bytes/s
Latency = Annotated[float, Field(ge=0.0, le=10.0)]  # seconds
Flops = Annotated[float, Field(ge=1e6, le=1e19)]  # FLOP/s
MemoryBytes = Annotated[float, Field(ge=2.0**20, le=2.0**50)]


class LinkEntry(Strict):
    name: Text
    bytes_per_s: Bandwidth
    latency_s: Latency


class DeviceEntry(Strict):
    name: Text
    match: list[Text] = []
    peak_flops: Annotated[dict[Text, Flops], Field(min_length=1)]
    hbm_bytes_per_s: Bandwidth
    memory_bytes: MemoryBytes
    fused_attention: bool = False


class ClusterFile(Strict):
    """A cluster JSON file (`ClusterSpec.to_json`): levels are [span, link] pairs."""

    name: Text
    device: Text
    n_devices: at_most(MAX_DEVICES)
    levels: Annotated[list[Annotated[tuple[at_most(MAX_DEVICES), LinkEntry], Pair]],
                      Field(min_length=1)]
    device_spec: DeviceEntry = None


_NVLINK4 = LinkSpec(name="nvlink4", bytes_per_s=450e9, latency_s=3e-6)
_IB_400 = LinkSpec(name="ib-400g", bytes_per_s=50e9, latency_s=8e-6)
_IB_100 = LinkSpec(name="ib-100g", bytes_per_s=12.5e9, latency_s=10e-6)
_NVLINK_V100 = LinkSpec(name="nvlink2", bytes_per_s=150e9, latency_s=4e-6)
# GA102's NVLink bridge: four x4 links of 14.0625 GB/s each way, 56.25 GB/s per direction
# between the two bridged GPUs (NVIDIA Ampere GA102 GPU Architecture, "Third-Generation NVLink").
_NVLINK_BRIDGE = LinkSpec(name="nvlink-bridge", bytes_per_s=56.25e9, latency_s=4e-6)
# PCIe between GeForce RTX 3090s: the driver gives GeForce cards no peer-to-peer access over
# PCIe ("CANNOT Access Peer" for every pair of an 8 x 3090 server, NVIDIA/nccl#1127), so every
# transfer stages through host memory. p2pBandwidthLatencyTest with P2P disabled measured 6.1
# GB/s one way and 8.6 GB/s both ways together between 3090s (PCIe 3.0, #1127), and 6.3 and
# 8.7 GB/s between two PCIe 4.0 GeForce cards (tinygrad/open-gpu-kernel-modules#44): the host
# copy, not the PCIe generation, is the limit. A ring collective or permute sends and receives
# on every GPU at once: half the bidirectional figure each way, 4.3 GB/s, after 12-17 us
# (#1127's latency matrix).
_PCIE_HOST_STAGED = LinkSpec(name="pcie-host-staged", bytes_per_s=4.3e9, latency_s=15e-6)
_NVLINK3 = LinkSpec(name="nvlink3", bytes_per_s=300e9, latency_s=3e-6)
_HOST = LinkSpec(name="host-memory", bytes_per_s=5e9, latency_s=20e-6)



def host_memory_bytes() -> float:
    """This host's memory: its physical memory, or the cgroup's limit where that is lower (a
    container)."""
    total = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = pathlib.Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, float(text))
    return total


# CPU devices are virtual devices of one host: `memory_bytes` is the host's, shared by all of a
# cluster's devices (`ClusterSpec.memory_per_device`).
DEVICES["cpu"] = DeviceSpec(name="cpu", match=("cpu",), hbm_bytes_per_s=10e9,
                            memory_bytes=host_memory_bytes(),
                            peak_flops={"bfloat16": 20e9, "float32": 20e9})

CLUSTERS: dict[str, ClusterSpec] = {
    c.name: c
    for c in (
        ClusterSpec(name="3090-nvlink-32", device="3090", n_devices=32,
                    levels=((2, _NVLINK_BRIDGE), (4, _PCIE_HOST_STAGED), (32, _IB_100))),
        ClusterSpec(name="3090-pcie-32", device="3090", n_devices=32,
                    levels=((4, _PCIE_HOST_STAGED), (32, _IB_100))),
        ClusterSpec(name="v100-32", device="v100", n_devices=32,
                    levels=((4, _NVLINK_V100), (32, _IB_100))),
        # Merak's setting (64 GPUs; its own hardware is not public): PrimePar's V100 nodes of 4,
        # 16 of them, and 8 H100 nodes of 8.
        ClusterSpec(name="v100-64", device="v100", n_devices=64,
                    levels=((4, _NVLINK_V100), (64, _IB_100))),
        ClusterSpec(name="h100-8", device="h100", n_devices=8, levels=((8, _NVLINK4),)),
        ClusterSpec(name="h100-32", device="h100", n_devices=32,
                    levels=((8, _NVLINK4), (32, _IB_400))),
        ClusterSpec(name="h100-64", device="h100", n_devices=64,
                    levels=((8, _NVLINK4), (64, _IB_400))),
        ClusterSpec(name="h200-8", device="h200", n_devices=8, levels=((8, _NVLINK4),)),
        ClusterSpec(name="cpu-8", device="cpu", n_devices=8, levels=((8, _HOST),)),
    )
}

GPUS_PER_NODE = 8
_TARGET_LINKS = {"h100": (_NVLINK4, _IB_400), "h200": (_NVLINK4, _IB_400),
                 "a100": (_NVLINK3, LinkSpec(name="ib-200g", bytes_per_s=25e9, latency_s=8e-6)),
                 # `3090:N`: nodes of 8 on PCIe, staged through host memory (the built-in
                 # 3090-pcie-32 and 3090-nvlink-32 are the 4-GPU nodes of the published runs).
                 "3090": (_PCIE_HOST_STAGED, _IB_100)}


def get_cluster(name: str) -> ClusterSpec:
    """A built-in cluster name, a GPU target like `h100:16` (nodes of 8), or a JSON file."""
    if name in CLUSTERS:
        return CLUSTERS[name]
    if ":" in name:
        kind, _, n = name.partition(":")
        if kind in _TARGET_LINKS and n.isdigit() and int(n) > 0:
            n = int(n)
            intra, inter = _TARGET_LINKS[kind]
            per_node = min(n, GPUS_PER_NODE)
            levels = ((per_node, intra),) + (((n, inter),) if n > per_node else ())
            return ClusterSpec(name=name, device=kind, n_devices=n, levels=levels)
    if name.endswith(".json"):
        data = read_json(name, "cluster file", CLUSTER_FIX)
        return ClusterSpec.from_json(data, f"cluster file {name!r}")
    raise UserError(
        f"unknown cluster {name!r}; use one of {', '.join(CLUSTERS)}, a target like h100:16, "
        "or a JSON file"
    )


@dataclasses.dataclass(frozen=True)
class Prices:
    """The datasheet price of one op on `device`: a GEMM or memory pass at its roofline, a
    collective by the alpha-beta model (`collective_time`) on the link it crosses.
    `async_collectives`: collectives run beside compute (False on CPUs, whose collectives are
    synchronous). `oases_jax.planner.cost.prices.Hardware` puts a calibration profile's fits in
    front of these prices; the MoE cost model (`oases_jax.moe.cost`) prices with either."""

    device: DeviceSpec
    async_collectives: bool = True

    @classmethod
    def of(cls, cluster: ClusterSpec) -> Prices:
        return cls(cluster.device_spec, async_collectives=cluster.device != "cpu")

    def gemm_s(self, flops: float, nbytes: float, dtype: str, chunks: int = 1) -> float:
        """max(FLOPs / peak, HBM bytes / bandwidth); `chunks` (calls) adds nothing here."""
        return max(flops / self.device.peak(dtype), nbytes / self.device.hbm_bytes_per_s)

    def mem_s(self, nbytes: float) -> float:
        """A memory-bound pass: bytes / HBM bandwidth."""
        return nbytes / self.device.hbm_bytes_per_s

    def collective_s(self, kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
        return collective_time(kind, nbytes, n, link)


def collective_time(kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
    """Alpha-beta cost of one collective over `n` devices (ring algorithms).

    all-reduce:          2 (n-1)/n * S / B + 2 (n-1) a
    all-gather:            (n-1)/n * S / B +   (n-1) a   (S = gathered output)
    reduce-scatter:        (n-1)/n * S / B +   (n-1) a   (S = input)
    all-to-all:            (n-1)/n * S / B +   (n-1) a
    collective-permute:              S / B +         a
    """
    if n <= 1 or nbytes == 0:
        return 0.0
    bw, a = link.bytes_per_s, link.latency_s
    if kind == "collective-permute":
        return nbytes / bw + a
    steps = n - 1
    if kind == "all-reduce":
        return 2 * steps / n * nbytes / bw + 2 * steps * a
    return steps / n * nbytes / bw + steps * a
