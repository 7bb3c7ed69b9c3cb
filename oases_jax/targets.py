"""Compile targets: the local devices, or GPU clusters compiled without a GPU (`h100:8`, ...).

The device facts XLA's GPU compiler needs live in the hardware table (`oases_jax.hardware`,
`COMPILE_FACTS` beside the devices' memory and bandwidth) and are turned here into a
`GpuTargetConfigProto` text for `jax.experimental.topologies`.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax

from oases_jax.errors import UserError
from oases_jax.hardware import (
    COMPILE_FACTS,
    DEVICES,
    GPUS_PER_NODE,
    ClusterSpec,
    compile_targets,
    get_cluster,
)

_INSTALL_HINT = "install the gpu-aot extra: .venv/bin/pip install -e '.[gpu-aot]'"


def target_config_text(gpu: str) -> str:
    """The `stream_executor.GpuTargetConfigProto` text for one GPU model of the hardware
    table: its compile facts, its memory size and its bandwidth."""
    spec = DEVICES[gpu]
    facts = {**COMPILE_FACTS[gpu], "memory_bandwidth": int(spec.hbm_bytes_per_s),
             "device_memory_size": int(spec.memory_bytes)}
    skip = ("description", "compute_capability")
    fields = "\n".join(f"  {k}: {v}" for k, v in facts.items() if k not in skip)
    major, minor = facts["compute_capability"]
    return (
        f"gpu_device_info {{\n{fields}\n"
        f"  cuda_compute_capability {{ major: {major} minor: {minor} }}\n}}\n"
        f'platform_name: "CUDA"\ndnn_version_info {{ major: 9 minor: 8 }}\n'
        f'device_description_str: "{facts["description"]}"\n'
    )


@dataclasses.dataclass(frozen=True)
class Target:
    """Where a program is compiled for: devices to build a mesh on, and the cluster they form."""

    name: str
    devices: tuple
    cluster: ClusterSpec
    is_gpu_aot: bool

    @property
    def platform(self) -> str:
        return "gpu" if self.is_gpu_aot else self.devices[0].platform


def has_gpu_aot() -> bool:
    try:
        import jax_plugins.xla_cuda12  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def cudnn_missing() -> str | None:
    """Why jax cannot trace cuDNN's fused attention in this process, or None when it can.

    jax asks the cuDNN library its version while tracing `dot_product_attention(...,
    implementation="cudnn")`, even for a deviceless GPU target whose compile never loads it;
    NVIDIA's wheel (the gpu-aot extra's `nvidia-cudnn-cu12`) is enough."""
    try:
        from jax._src.lib import cuda_versions
    except ImportError:  # another jax layout: let its own check speak at trace time
        return None
    if cuda_versions is None:
        return f"jax's CUDA plugin is not installed; {_INSTALL_HINT}"
    try:
        cuda_versions.cudnn_get_version()
    except Exception as e:  # RuntimeError("cuDNN not found.")
        return f"{str(e).strip()[:120]} (jax's trace-time cuDNN version check); {_INSTALL_HINT}"
    return None


@functools.cache
def _gpu_devices(gpu: str, n: int) -> tuple:
    from jax.experimental import topologies

    nodes, per_node = (1, n) if n <= GPUS_PER_NODE else (n // GPUS_PER_NODE, GPUS_PER_NODE)
    try:
        topo = topologies.get_topology_desc(
            platform="cuda", topology=f"{nodes}x1x{per_node}", target_config=target_config_text(gpu)
        )
    except Exception as e:  # the plugin is missing or cannot load
        raise UserError(f"cannot compile for {gpu}:{n} ({str(e)[:120]}); {_INSTALL_HINT}") from None
    return tuple(topo.devices)


def get_target(name: str) -> Target:
    """`local` (the devices at hand) or `GPU:N` with GPU in h100, h200, a100, 3090."""
    if name == "local":
        devices = tuple(jax.devices())
        kind = devices[0].device_kind
        cluster_name = next((k for k in compile_targets() if k.upper() in kind.upper()), None)
        n = len(devices)
        cluster = get_cluster(f"{cluster_name}:{n}") if cluster_name else get_cluster("cpu-8")
        if not cluster_name and n != 8:
            cluster = dataclasses.replace(cluster, n_devices=n, levels=((n, cluster.levels[0][1]),))
        return Target(name, devices, cluster, is_gpu_aot=False)
    m = re.fullmatch(rf"({'|'.join(compile_targets())}):(\d+)", name)
    if not m:
        raise UserError(f"unknown target {name!r}; use local or GPU:N with GPU one of "
                        f"{', '.join(compile_targets())} (e.g. h100:8)")
    gpu, n = m.group(1), int(m.group(2))
    if n > GPUS_PER_NODE and n % GPUS_PER_NODE:
        raise UserError(f"target {name}: beyond 8 GPUs use whole nodes of 8, e.g. 16 or 24")
    if not has_gpu_aot():
        raise UserError(f"target {name} needs the CUDA compiler plugin; {_INSTALL_HINT}")
    return Target(name, _gpu_devices(gpu, n), get_cluster(name), is_gpu_aot=True)
