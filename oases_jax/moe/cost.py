"""The alpha-beta cost model of one MoE layer under each MoE schedule, and `auto`'s choice.

Each op is priced by one hardware object (`MoEHardware.prices`): the datasheet's
(`oases_jax.hardware.Prices`: roofline GEMMs and memory passes, alpha-beta collectives on the
link a group crosses) where the runtime's `auto` asks, the planner's `Hardware` (a calibration
profile's or XLA's fits in front of the datasheet) where the planner does. A layer's forward and
backward are each a list of tasks in the compiled program's order on the project's two-stream
engine (`oases_jax.streams.Streams`): a compute stream and one collective stream (XLA's GPU
runtime issues every asynchronous collective on one stream; two, one per link level, under
`MoEHardware.concurrent_links`, Parm's premise; one for everything where collectives are
synchronous, as on CPU): the weights' cast, gate and dispatch, per capacity chunk the dispatch
all-to-all, ESP all-gather, expert FFN, ESP reduce-scatter and all-to-all back, the combine and
the restore of the MP ranks' tokens; the backward mirrors them (all-to-all <-> all-to-all, all-
gather <-> reduce-scatter) over its own chunk count, with the FFN's input gradients per forward
chunk, its weight gradients beside the backward's last collectives, and the router's all-
reduces. With one chunk this is S1; with r, chunk i's collectives run while chunk i-1's GEMMs do
(S2), each chunk paying its own latency terms. Where the model disagreed with the compiled
programs, and why it was changed: docs/parallelism.md, "Mixture of experts". It lives beside the
MoE runtime: the runtime gets `choose_for_mesh` as `MoESetup.choose` from the training layer.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol

from oases_jax.hardware import ClusterSpec, LinkSpec, Prices, compile_targets, get_cluster
from oases_jax.moe.chunked import padded_slots
from oases_jax.moe.routing import capacity
from oases_jax.moe.schedules import get as schedule_spec
from oases_jax.streams import COMPUTE, Streams

CHUNKS = (1, 2, 4, 8)  # parm_s2's chunk counts `auto` tries (1 is parm_s1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerShape:
    """One MoE layer on a mesh. `tokens`: tokens per (data, expert) shard, i.e. per MP group;
    d_ff: one expert's FFN width; gated: SwiGLU (three matrices) rather than two; bias: the
    experts have biases (GPT-2's)."""

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
    bias: bool = False


class OpPrices(Protocol):
    """What prices one op: `oases_jax.hardware.Prices` or the planner's `Hardware`."""

    async_collectives: bool

    def gemm_s(self, flops: float, nbytes: float, dtype: str, chunks: int = 1) -> float: ...

    def mem_s(self, nbytes: float) -> float: ...

    def collective_s(self, kind: str, nbytes: float, n: int, link: LinkSpec) -> float: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEHardware:
    """What the model prices with: the op prices, the links the EP and MP groups cross,
    whether they are one link level, and whether collectives on two link levels run at the same
    time (`concurrent_links`: Parm's premise; XLA's GPU runtime as this project compiles for it
    issues every asynchronous collective on one collective stream, so they run one after
    another, as the simulator replays them: docs/parallelism.md, "What the compiled programs
    say"). Collectives run beside compute where the prices say they are asynchronous;
    `comm=False` prices the layer's compute alone (its collectives cost nothing)."""

    prices: OpPrices
    ep_link: LinkSpec
    mp_link: LinkSpec
    same_level: bool
    concurrent_links: bool = False
    comm: bool = True

    @classmethod
    def of(cls, cluster: ClusterSpec, ep_group, mp_group, prices: OpPrices | None = None
           ) -> MoEHardware:
        """The links of the EP and MP groups (device ids) on `cluster`, priced by `prices`
        (default: the cluster's datasheet)."""
        ep_link, mp_link = cluster.link_for(ep_group), cluster.link_for(mp_group)
        return cls(prices=prices or Prices.of(cluster), ep_link=ep_link, mp_link=mp_link,
                   same_level=ep_link == mp_link)

    @property
    def overlap(self) -> bool:
        return self.prices.async_collectives

    def collective_s(self, kind: str, nbytes: float, n: int, link: LinkSpec) -> float:
        return self.prices.collective_s(kind, nbytes, n, link) if self.comm else 0.0

    def gemm_s(self, flops: float, nbytes: float, dtype_bytes: int) -> float:
        """One GEMM (or any op) at the prices' rate for the compute dtype."""
        return self.prices.gemm_s(flops, nbytes, "float32" if dtype_bytes >= 4 else "bfloat16")

    def mem_s(self, nbytes: float) -> float:
        return self.prices.mem_s(nbytes)


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective as the compiled program holds it: kind, mesh axis, the per-device bytes
    `oases_jax.hardware.collective_time` takes (all-gather: the gathered output; reduce-scatter: the
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
    backward_chunks: int = 1

    @property
    def label(self) -> str:
        """`parm_s2/4` (equal counts) or `parm_s2/2+4` (forward+backward); the bare name else."""
        if not schedule_spec(self.schedule).chunked:
            return self.schedule
        if self.chunks == self.backward_chunks:
            return f"{self.schedule}/{self.chunks}"
        return f"{self.schedule}/{self.chunks}+{self.backward_chunks}"

    @property
    def total_s(self) -> float:
        return self.forward_s + self.backward_s


def slots(shape: LayerShape, schedule: str, chunks: int = 1,
          backward_chunks: int | None = None) -> int:
    """Slots per expert in one device's dispatch buffer (per chunk: divide by the chunk count):
    S1/S2 gate T/mp tokens with C = ceil(f k T/(mp E)) (S2 pads C to a multiple of both its
    forward and backward chunk counts); ds_moe gates all T tokens with C rounded up to a
    multiple of mp and keeps C/mp."""
    f, k, e, mp = shape.capacity_factor, shape.top_k, shape.experts, shape.mp
    if not schedule_spec(schedule).dedup:
        return capacity(shape.tokens, e, k, f, mp) // mp
    return padded_slots(capacity(shape.tokens // mp, e, k, f), chunks, backward_chunks or chunks)


def collectives(shape: LayerShape, schedule: str, chunks: int = 1, *, restore: bool = True,
                backward_chunks: int | None = None) -> tuple[Collective, ...]:
    """The MoE path's collectives of one layer's forward, per device (the backward has the
    same kinds and bytes, over `backward_chunks` chunks). Byte counts are those of the compiled
    program's operands. `restore`: with the collective that gives the MP ranks their tokens
    back after the combine (ds_moe's all-reduce inside the layer; for S1/S2 the residual
    stream's all-gather under `megatron`, outside the layer's shard_map)."""
    s = slots(shape, schedule, chunks, backward_chunks)
    e, d, b, mp, ep = shape.experts, shape.d_model, shape.dtype_bytes, shape.mp, shape.ep
    chunk = e * (s // chunks) * d * b  # one chunk's [E, S/r, D] buffer
    out = []
    if ep > 1:
        out.append(Collective("all-to-all", "expert", chunk, ep, 2 * chunks))
    if mp > 1:
        out.append(Collective("all-gather", "tensor", chunk * mp, mp, chunks))
        out.append(Collective("reduce-scatter", "tensor", chunk * mp, mp, chunks))
        if not schedule_spec(schedule).dedup:
            out.append(Collective("all-reduce", "tensor", shape.tokens * d * b, mp))
        elif restore:
            out.append(Collective("all-gather", "tensor", shape.tokens * d * b, mp))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class _FFN:
    """Seconds of the local experts' FFN on one chunk's rows (all local experts together),
    priced op by op as the compiled program runs them. Per matrix [D, F/mp] (three for SwiGLU),
    2 * rows * D * F/mp FLOPs per GEMM: `forward` (reads the weights; the activation's
    elementwise pass: 3 passes over the [rows, F/mp] hidden activation), `input_grad` (reads the
    weights; the activation's gradient: 4 passes), `weight_grad` (writes the weight gradient:
    float32 where one chunk's is the whole gradient, else each chunk's in the compute dtype,
    read again by the sum: 2 bytes per weight either way in bf16)."""

    forward: float
    input_grad: float
    weight_grad: float

    @classmethod
    def of(cls, shape: LayerShape, hw: MoEHardware, rows: int) -> _FFN:
        d, f, b = shape.d_model, shape.d_ff // shape.mp, shape.dtype_bytes
        w = shape.experts // shape.ep * d * f * b  # one matrix of every local expert
        flops, io, act = 2.0 * rows * d * f, rows * (d + f) * b, rows * f * b
        mats = 3 if shape.gated else 2
        return cls(forward=mats * hw.gemm_s(flops, w + io, b) + hw.mem_s(3 * act),
                   input_grad=mats * hw.gemm_s(flops, w + io, b) + hw.mem_s(4 * act),
                   weight_grad=mats * hw.gemm_s(flops, 2 * w + io, b))


def _chunks(tasks: Streams, stream: str, seconds: float, n: int, deps_of) -> list[int]:
    """n chunk tasks on `stream`; chunk i depends on `deps_of(i, n)`."""
    return [tasks.add(stream, seconds, deps_of(i, n)) for i in range(n)]


def _over(tasks: list[int]):
    """deps_of for chunks that wait on the chunks of `tasks` covering the same slots."""
    m = len(tasks)
    return lambda i, n: [tasks[j] for j in range(m) if i * m < (j + 1) * n and j * n < (i + 1) * m]


def estimate(shape: LayerShape, hw: MoEHardware, schedule: str, chunks: int = 1,
             backward_chunks: int | None = None) -> Estimate:
    """Forward and backward seconds of one MoE layer's routed part under `schedule`, parm_s2 with
    `chunks` forward and `backward_chunks` (default: the same) backward chunks, as a list of
    tasks in the compiled program's order on a compute stream and the collective stream
    (`oases_jax.streams.Streams`). Forward: the weights' cast to the compute dtype; gate and
    dispatch; per chunk all-to-all -> ESP all-gather -> FFN -> ESP reduce-scatter -> all-to-all
    back (with expert biases every reduce-scatter waits for every chunk's FFN: XLA fuses the
    chunks' output-bias additions into one fusion); combine; the restore of the MP ranks'
    tokens. Backward: the combine's transpose; per backward chunk the mirrored all-to-all and
    all-gather; per forward chunk the FFN's input gradient (autodiff transposes each forward
    chunk's FFN; where the counts differ the buffers are re-cut between them, a read and a write
    of each, twice); per backward chunk reduce-scatter and all-to-all back, while the weight
    gradients run; the dispatch's and router's transposes; the all-reduces of the router's
    statistics and gradient (`_router_all_reduces`) and the restore's mirror."""
    rf, rb = chunks, backward_chunks or chunks
    s = slots(shape, schedule, rf, rb)
    e, d, b, mp, ep = shape.experts, shape.d_model, shape.dtype_bytes, shape.mp, shape.ep
    # Resources: collectives share one stream (two when they run at once on two link levels);
    # where collectives are synchronous (CPU) everything is serial.
    ep_res, mp_res = (("ep", "mp") if hw.concurrent_links and not hw.same_level
                      else ("comm", "comm"))
    if not hw.overlap:
        ep_res = mp_res = COMPUTE

    def comm(r):
        n = e * (s // r) * d * b  # one chunk's [E, S/r, D] buffer
        return (hw.collective_s("all-to-all", n, ep, hw.ep_link),
                hw.collective_s("all-gather", n * mp, mp, hw.mp_link),
                hw.collective_s("reduce-scatter", n * mp, mp, hw.mp_link))

    ffn = _FFN.of(shape, hw, e * mp * s // rf)  # E/ep local experts x mp*ep*S/rf rows
    rechunk = 0.0 if rf == rb else hw.mem_s(2 * 2 * e * mp * s * d * b) / rf
    dedup = schedule_spec(schedule).dedup
    tokens = shape.tokens // mp if dedup else shape.tokens
    gate = hw.gemm_s(2.0 * tokens * d * e, tokens * d * b, b)
    row = hw.mem_s(tokens * d * b)  # one pass over the gated tokens
    k = shape.top_k
    restore = hw.collective_s("all-gather" if dedup else "all-reduce",
                              shape.tokens * d * b, mp, hw.mp_link)
    stats_ar, grad_ar = _router_all_reduces(shape, hw, schedule)
    mats = 3 if shape.gated else 2
    cast = hw.mem_s(mats * 3 * e // ep * d * (shape.d_ff // mp) * b)  # float32 read, bf16 write

    a2a, ag, rs = comm(rf)
    f = Streams()
    f.add(COMPUTE, cast)
    # gate: the router reads each token; dispatch: a gather of its k copies
    route = f.add(COMPUTE, gate + (k + 1) * row)
    sent = _chunks(f, ep_res, a2a, rf, lambda i, n: [route])
    got = _chunks(f, mp_res, ag, rf, _over(sent))
    ran = _chunks(f, COMPUTE, ffn.forward, rf, _over(got))
    summed = _chunks(f, mp_res, rs, rf, (lambda i, n: ran) if shape.bias else _over(ran))
    back = _chunks(f, ep_res, a2a, rf, _over(summed))
    combined = f.add(COMPUTE, (k + 1) * row, back)  # reads k rows, writes one
    f.add(mp_res, restore, [combined])

    a2a, ag, rs = comm(rb)
    g = Streams()
    # the combine's transpose: reads the token gradient, writes k rows; the gates' gradient
    # reads the k expert rows
    comb_t = g.add(COMPUTE, (2 * k + 1) * row)
    sent = _chunks(g, ep_res, a2a, rb, lambda i, n: [comb_t])
    got = _chunks(g, mp_res, ag, rb, _over(sent))
    ran = _chunks(g, COMPUTE, ffn.input_grad + rechunk, rf, _over(got))
    g.add(ep_res, stats_ar)
    summed = _chunks(g, mp_res, rs, rb, _over(ran))
    back = _chunks(g, ep_res, a2a, rb, _over(summed))
    _chunks(g, COMPUTE, ffn.weight_grad, rf, _over(got))
    # the dispatch's transpose: reads k rows, scatter-adds into one; the router's input gradient
    disp_t = g.add(COMPUTE, 2 * gate + (k + 2) * row, back)
    g.add(ep_res, grad_ar, [disp_t])
    g.add(mp_res, restore, [disp_t])
    return Estimate(schedule, rf, f.makespan, g.makespan,
                    collectives(shape, schedule, rf, backward_chunks=rb), rb)


def _router_all_reduces(shape: LayerShape, hw: MoEHardware, schedule: str
                        ) -> tuple[float, float]:
    """Seconds of the router's two all-reduces: its statistics (2E + 3 float32 sums, for the
    losses' gradients) and its [D, E] float32 gradient, over the token groups' devices on the
    slowest link they cross (S1/S2: data x expert x tensor; ds_moe, whose MP ranks gate the same
    tokens: data x expert). Latency-bound: 2 (n - 1) alpha each, so S1's groups, MP times larger
    than ds_moe's, pay MP times the steps."""
    dedup = schedule_spec(schedule).dedup
    n = shape.dp * shape.ep * (shape.mp if dedup else 1)
    links = [hw.ep_link] + ([hw.mp_link] if dedup and shape.mp > 1 else [])
    link = min(links, key=lambda lk: lk.bytes_per_s)
    return (hw.collective_s("all-reduce", (2 * shape.experts + 3) * 4, n, link),
            hw.collective_s("all-reduce", shape.d_model * shape.experts * 4, n, link))


def chunk_pairs(shape: LayerShape, chunks=CHUNKS) -> tuple[tuple[int, int], ...]:
    """The (forward, backward) chunk counts `auto` weighs: every pair of `chunks` up to the
    slots per expert ((1, 1) is parm_s1)."""
    top = slots(shape, "parm_s1")
    return tuple((f, b) for f in chunks for b in chunks if f <= top and b <= top)


def choose(shape: LayerShape, hw: MoEHardware, pairs=None) -> Estimate:
    """`auto`: the cheapest (forward + backward) of parm_s1, parm_s2 over (forward, backward)
    chunk counts (`pairs`, default `chunk_pairs`) and ds_moe; ties go to parm_s1, then to
    fewer chunks, and to Parm's schedules over ds_moe. ds_moe keeps other tokens than S1 and
    S2 when capacity drops some (its token groups are whole MP groups), as the mesh's shape
    already changes the groups; it wins where the layer is latency-bound (its router
    all-reduces span MP times fewer devices: docs/parallelism.md, "Mixture of experts")."""
    best = estimate(shape, hw, "parm_s1")
    for f, b in sorted(pairs or chunk_pairs(shape), key=lambda p: (max(p), p)):
        if (f, b) != (1, 1):
            est = estimate(shape, hw, "parm_s2", f, b)
            if est.total_s < best.total_s:
                best = est
    base = estimate(shape, hw, "ds_moe")
    return base if base.total_s < best.total_s else best


def choose_for_mesh(*, mesh, ep_axis: str | None, mp_axis: str | None, pairs=None,
                    **shape) -> tuple[str, int, int]:
    """`auto` for one layer on `mesh` (`oases_jax.moe.MoESetup.choose`): (schedule, forward
    chunks, backward chunks)."""
    best = choose(LayerShape(**shape), links_of_mesh(mesh, ep_axis, mp_axis), pairs)
    return best.schedule, best.chunks, best.backward_chunks


def links_of_mesh(mesh, ep_axis: str | None, mp_axis: str | None) -> MoEHardware:
    """The hardware a mesh's devices stand for (a GPU target by its device kind, nodes of 8;
    CPUs as one host) and the device ids of the EP and MP groups through its first device."""
    import numpy as np

    devices = np.asarray(mesh.devices)
    n = devices.size
    kind = devices.flat[0].device_kind
    gpu = next((g for g in compile_targets() if g.upper() in kind.upper()), None)
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
            "parm_s2_chunks": s2.chunks, "auto": auto.label,
            "auto_s": auto.total_s, "speedup": base.total_s / auto.total_s}
