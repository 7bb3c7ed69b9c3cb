"""The alpha-beta cost model of one MoE layer under each MoE schedule, and `auto`'s choice.

Each collective costs `simulate.collective_time` on the link its group crosses (the planner's
hardware model, `oases_jax.analysis.hardware`); the layer's work is a list of stages per
capacity chunk (dispatch all-to-all, ESP all-gather, expert FFN, ESP reduce-scatter, all-to-all
back) on three resources: the EP link, the MP link and the compute units. A stage starts when
the chunk's previous stage has ended and its resource is free; collectives on the same link
level share one resource, and nothing overlaps where collectives are synchronous (CPU). With
one chunk this is the plain sum (S1); with r chunks chunk i's all-gather runs while chunk i+1's
all-to-all is in flight (S2), each paying its own latency terms. The backward runs the mirrored
stages (all-to-all <-> all-to-all, all-gather <-> reduce-scatter) with twice the FFN FLOPs.
Formulas and their derivation: docs/parallelism.md, "Mixture of experts". It lives with the
analysis tools (it prices with their hardware model); the runtime gets `choose_for_mesh` as
`MoESetup.choose` from the training layer.
"""

from __future__ import annotations

import dataclasses

from oases_jax.analysis.hardware import ClusterSpec, DeviceSpec, LinkSpec, get_cluster
from oases_jax.analysis.simulate import collective_time
from oases_jax.moe.routing import capacity

CHUNKS = (1, 2, 4, 8)  # parm_s2's chunk counts `auto` tries (1 is parm_s1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One MoE layer on a mesh. `tokens`: tokens per (data, expert) shard, i.e. per MP group;
    d_ff: one expert's FFN width; gated: SwiGLU (three matrices) rather than two."""

    tokens: int
    d_model: int
    d_ff: int
    experts: int
    top_k: int
    capacity_factor: float
    dtype_bytes: int = 2
    gated: bool = False
    ep: int = 1
    mp: int = 1
    dp: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEHardware:
    """What the model prices with: the device, the links the EP and MP groups cross, whether
    they are one link level (their collectives then share it), and whether collectives run
    asynchronously beside other work."""

    device: DeviceSpec
    ep_link: LinkSpec
    mp_link: LinkSpec
    same_level: bool
    overlap: bool = True

    @classmethod
    def of(cls, cluster: ClusterSpec, ep_group, mp_group) -> MoEHardware:
        ep_link, mp_link = cluster.link_for(ep_group), cluster.link_for(mp_group)
        return cls(device=cluster.device_spec, ep_link=ep_link, mp_link=mp_link,
                   same_level=ep_link == mp_link, overlap=cluster.device != "cpu")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as the compiled program holds it: kind, mesh axis, the per-device bytes
    `simulate.collective_time` takes (all-gather: the gathered output; reduce-scatter: the
    input; all-to-all and all-reduce: the buffer), group size, and count per layer forward."""

    kind: str
    axis: str
    nbytes: int
    group: int
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Estimate:
    schedule: str
    chunks: int
    forward_s: float
    backward_s: float
    collectives: tuple[Collective, ...]

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def slots(shape: LayerShape, schedule: str, chunks: int = 1) -> int:
    """Slots per expert in one device's dispatch buffer (per chunk: divide by `chunks`):
    S1/S2 gate T/mp tokens with C = ceil(f k T/(mp E)) (S2 pads C to a multiple of the chunk
    count); ds_moe gates all T tokens with C rounded up to a multiple of mp and keeps C/mp."""
    f, k, e, mp = shape.capacity_factor, shape.top_k, shape.experts, shape.mp
    if schedule == "ds_moe":
        return capacity(shape.tokens, e, k, f, mp) // mp
    c = capacity(shape.tokens // mp, e, k, f)
    return -(-c // chunks) * chunks


def collectives(shape: LayerShape, schedule: str, chunks: int = 1, *, restore: bool = True
                ) -> tuple[Collective, ...]:
    """The MoE path's collectives of one layer's forward, per device. Byte counts are those of
    the compiled program's operands. `restore`: with the collective that gives the MP ranks
    their tokens back after the combine (ds_moe's all-reduce inside the layer; for S1/S2 the
    residual stream's all-gather under `megatron`, outside the layer's shard_map)."""
    s = slots(shape, schedule, chunks)
    e, d, b, mp, ep = shape.experts, shape.d_model, shape.dtype_bytes, shape.mp, shape.ep
    chunk = e * (s // chunks) * d * b  # one chunk's [E, S/r, D] buffer
    out = []
    if ep > 1:
        out.append(Collective("all-to-all", "expert", chunk, ep, 2 * chunks))
    if mp > 1:
        out.append(Collective("all-gather", "tensor", chunk * mp, mp, chunks))
        out.append(Collective("reduce-scatter", "tensor", chunk * mp, mp, chunks))
        if schedule == "ds_moe":
            out.append(Collective("all-reduce", "tensor", shape.tokens * d * b, mp))
        elif restore:
            out.append(Collective("all-gather", "tensor", shape.tokens * d * b, mp))
    return tuple(out)


def _ffn_flops(shape: LayerShape, n_slots: int) -> float:
    """Forward FLOPs of the local experts on n_slots rows: 2 * rows * D * F/mp per matrix."""
    mats = 3 if shape.gated else 2
    return 2.0 * n_slots * shape.d_model * (shape.d_ff / shape.mp) * mats


def _compute_s(hw: MoEHardware, flops: float, nbytes: float, dtype_bytes: int) -> float:
    dtype = "float32" if dtype_bytes >= 4 else "bfloat16"
    return max(flops / hw.device.peak(dtype), nbytes / hw.device.hbm_bytes_per_s)


def _pipeline(stages: list[list[tuple[str, float]]]) -> float:
    """Makespan of chunks' stage lists [(resource, seconds), ...]: a chunk's stages run in order,
    and each resource runs one stage at a time in program order, stage by stage and within a
    stage chunk by chunk (every chunk's dispatch all-to-all is issued before any all-to-all
    back), so chunk i's all-gather runs while chunk i+1's all-to-all is in flight."""
    free: dict[str, float] = {}
    ends = [0.0] * len(stages)
    for step in range(len(stages[0])):
        for c, chunk in enumerate(stages):
            res, dur = chunk[step]
            ends[c] = max(ends[c], free.get(res, 0.0)) + dur
            free[res] = ends[c]
    return max(ends)


def estimate(shape: LayerShape, hw: MoEHardware, schedule: str, chunks: int = 1) -> Estimate:
    """Forward and backward seconds of one MoE layer's routed part under `schedule`."""
    s = slots(shape, schedule, chunks)
    sc = s // chunks
    e, d, b, mp, ep = shape.experts, shape.d_model, shape.dtype_bytes, shape.mp, shape.ep
    chunk = e * sc * d * b
    # Resources: collectives on two link levels overlap; on one level they share it; where
    # collectives are synchronous (CPU) everything is serial.
    ep_res, mp_res = ("ep", "mp") if not hw.same_level else ("link", "link")
    if not hw.overlap:
        ep_res = mp_res = "compute"
    a2a = collective_time("all-to-all", chunk, ep, hw.ep_link)
    ag = collective_time("all-gather", chunk * mp, mp, hw.mp_link)
    rs = collective_time("reduce-scatter", chunk * mp, mp, hw.mp_link)
    rows = e // ep * mp * ep * sc  # local experts' rows per chunk
    mats = 3 if shape.gated else 2
    w_bytes = e // ep * d * shape.d_ff // mp * mats * b
    ffn = _compute_s(hw, _ffn_flops(shape, rows), w_bytes + 2 * rows * d * b, b)
    fwd = [[(ep_res, a2a), (mp_res, ag), ("compute", ffn), (mp_res, rs), (ep_res, a2a)]
           for _ in range(chunks)]
    bwd = [[(ep_res, a2a), (mp_res, ag), ("compute", 2 * ffn), (mp_res, rs), (ep_res, a2a)]
           for _ in range(chunks)]
    tokens = shape.tokens if schedule == "ds_moe" else shape.tokens // mp
    gate = _compute_s(hw, 2.0 * tokens * d * e, tokens * d * b, b)
    restore_kind = "all-reduce" if schedule == "ds_moe" else "all-gather"
    restore = collective_time(restore_kind, shape.tokens * d * b, mp, hw.mp_link)
    # The restore's backward: a reduce-scatter of the same bytes (an all-reduce for ds_moe).
    return Estimate(schedule, chunks, gate + _pipeline(fwd) + restore,
                    2 * gate + _pipeline(bwd) + restore, collectives(shape, schedule, chunks))


def choose(shape: LayerShape, hw: MoEHardware, chunks=CHUNKS) -> Estimate:
    """`auto`: the cheapest (forward + backward) of parm_s1 and parm_s2 over `chunks` (chunk
    counts past the slots per expert are skipped); ties go to fewer chunks."""
    best = estimate(shape, hw, "parm_s1")
    for r in chunks:
        if r > 1 and r <= slots(shape, "parm_s1"):
            est = estimate(shape, hw, "parm_s2", r)
            if est.total_s < best.total_s:
                best = est
    return best


def choose_for_mesh(*, mesh, ep_axis: str | None, mp_axis: str | None, chunks=CHUNKS,
                    **shape) -> tuple[str, int]:
    """`auto` for one layer on `mesh` (`oases_jax.moe.MoESetup.choose`): (schedule, chunks)."""
    best = choose(LayerShape(**shape), links_of_mesh(mesh, ep_axis, mp_axis), chunks)
    return best.schedule, best.chunks


def links_of_mesh(mesh, ep_axis: str | None, mp_axis: str | None) -> MoEHardware:
    """The hardware a mesh's devices stand for (a GPU target by its device kind, nodes of 8;
    CPUs as one host) and the device ids of the EP and MP groups through its first device."""
    import numpy as np

    from oases_jax.analysis.targets import GPU_FACTS

    devices = np.asarray(mesh.devices)
    n = devices.size
    kind = devices.flat[0].device_kind
    gpu = next((g for g in GPU_FACTS if g.upper() in kind.upper()), None)
    if gpu is not None:
        cluster = get_cluster(f"{gpu}:{n}")
    else:
        cpu = get_cluster("cpu-8")
        cluster = dataclasses.replace(cpu, name=f"cpu-{n}", n_devices=n,
                                      levels=((n, cpu.levels[0][1]),))

    def group(axis):
        if axis is None:
            return [devices.flat[0].id]
        i = mesh.axis_names.index(axis)
        index = tuple(slice(None) if j == i else 0 for j in range(devices.ndim))
        return [dv.id for dv in devices[index].flat]

    return MoEHardware.of(cluster, group(ep_axis), group(mp_axis))


def speedup(shape: LayerShape, hw: MoEHardware) -> dict:
    """Each schedule's forward + backward time and the auto choice (for sweeps and reports)."""
    base = estimate(shape, hw, "ds_moe")
    s1 = estimate(shape, hw, "parm_s1")
    s2 = min((estimate(shape, hw, "parm_s2", r) for r in CHUNKS[1:]
              if r <= slots(shape, "parm_s1")), key=lambda x: x.total_s, default=s1)
    auto = choose(shape, hw)
    return {"ds_moe_s": base.total_s, "parm_s1_s": s1.total_s, "parm_s2_s": s2.total_s,
            "parm_s2_chunks": s2.chunks, "auto": f"{auto.schedule}/{auto.chunks}",
            "auto_s": auto.total_s, "speedup": base.total_s / auto.total_s}
