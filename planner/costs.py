"""The planner's cost model: pure functions from (model, cluster, layout, per-layer strategy) to
seconds and bytes per device.

Every time comes out of one replay rule, the same as the inspection simulator's
(`oases_jax.analysis.simulate`): work is a list of ops on two streams, compute and communication.

    compute c:   runs on the compute stream
    start i, m:  collective i (m seconds) starts when the compute stream has issued it and the
                 communication stream is free
    done i:      the compute stream waits for collective i

So a collective hides behind exactly the compute issued between its start and its done, and a
stage of an overlapped schedule costs max(compute, comm). Each strategy below writes its layer's
forward, backward and recomputation as such a list (`layer_ops`), in the order our
implementation issues them; `replay` prices it. Compute ops cost the roofline
max(FLOPs / peak, bytes / HBM bandwidth) (or a calibration profile's fitted GEMM time), and
collectives the alpha-beta model of `oases_jax.analysis.simulate.collective_time` (or the
profile's fit).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax.numpy as jnp

from models.config import ModelConfig
from oases_jax.analysis.hardware import ClusterSpec
from oases_jax.analysis.simulate import collective_time
from oases_jax.layer_plan import SEQUENCE_PARALLEL
from oases_jax.tensor_parallel import RING_SCHEDULES as RING
from oases_jax.tensor_parallel import SUB_BATCH_SCHEDULES as SUB_BATCH

# Strategies the planner chooses between, per layer.
TP_SCHEDULES = ("megatron", "megatron_sp", "collective_matmul", "oases", "oases_cm",
                "primepar")  # primepar: on its own square layouts (Layout.primepar) only
REMATS = ("none", "save_proj", "full")
# Passes over the f32 logits of a micro-batch, forward and backward, counted in the compiled
# GPU loss (gpt2-1.5b shape, h100:8): the max, the exponentials and their sum, the label pick,
# the softmax's recomputation, its gradient and the casts around them.
LOGIT_PASSES = 9
OPTIMIZER_PASSES = 7  # AdamW reads p, g, m, v and writes p, m, v (fp32 each)
# A scanned layer stack stores each layer's saved activations into stacked buffers: XLA
# initialises them, writes each layer's slice, and transposes them for the backward loop.
SCAN_PASSES = 4
# Memory passes over the layer's residual stream (T D e bytes) that a schedule's compiled
# layer spends beyond the roofline of its GEMMs, norms and softmax: splitting and joining
# sub-batches, the all-to-alls and transposes XLA inserts around sequence-sharded attention,
# and the ring schedules' chunk slicing, accumulation and concatenation. Calibrated from the
# compiled fwd+bwd of one `gpt2-1.5b` layer on h100:8, tensor=8 (docs/planner.md).
SCHEDULE_PASSES = {"none": 0.0, "megatron": 4.0, "oases": 22.0, "megatron_sp": 22.0,
                   "collective_matmul": 74.0, "oases_cm": 115.0}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How the devices and the batch are split: data x fsdp x tensor = devices, and the global
    batch into `microbatches` accumulated micro-batches of `global_batch / microbatches` rows.

    The built-in `fsdp` and `fsdp_tp` rule sets shard the parameters over every replica (the
    mesh's `data` axis), so a layout is either replicated (`fsdp == 1`) or fully sharded
    (`data == 1`, `fsdp` = all replicas); its mesh names the replica axis `data` either way.

    A `primepar` layout's tensor group is a q x q square (`tensor` = q^2, mesh axes `tp_row` and
    `tp_col`, rules `primepar`); its parameters are stacked with one sharding, so every layer of
    its plans runs `primepar` (`planner.primepar_cost`)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    microbatches: int = 1
    global_batch: int
    seq_len: int
    primepar: bool = False

    def __post_init__(self):
        if self.fsdp > 1 and self.data > 1:
            raise ValueError(f"data={self.data} x fsdp={self.fsdp}: the fsdp rule sets shard "
                             "over all replicas; use data=1 with fsdp = the replica count")
        if self.primepar and (self.fsdp > 1 or self.square ** 2 != self.tensor
                              or self.square < 2):
            raise ValueError(f"a primepar layout needs tensor = q^2 with q >= 2 and no fsdp, "
                             f"got tensor={self.tensor}, fsdp={self.fsdp}")

    @property
    def square(self) -> int:
        """q, the side of a primepar layout's square (1 otherwise)."""
        return math.isqrt(self.tensor) if self.primepar else 1

    @property
    def n_devices(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def replicas(self) -> int:
        return self.data * self.fsdp

    @property
    def rows(self) -> int:
        """Rows of one micro-batch on one device (before sub-batching)."""
        return self.global_batch // (self.replicas * self.microbatches)

    def mesh(self) -> dict[str, int]:
        """The training mesh: replicas on `data` (sharded or not, per `rules()`), then tensor
        (or primepar's square, `tp_row` x `tp_col`)."""
        axes = {"data": self.replicas, "tensor": self.tensor}
        if self.primepar:
            axes = {"data": self.replicas, "tp_row": self.square, "tp_col": self.square}
        return {k: v for k, v in axes.items() if v > 1} or {"data": 1}

    def rules(self) -> str:
        if self.primepar:
            return "primepar"
        if self.tensor > 1:
            return "fsdp_tp" if self.fsdp > 1 else "tp"
        return "fsdp" if self.fsdp > 1 else "dp"

    def label(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh().items())
        return (mesh + (" fsdp" if self.fsdp > 1 else "")
                + (f" x{self.microbatches}mb" if self.microbatches > 1 else ""))


@dataclasses.dataclass(frozen=True, kw_only=True, order=True)
class Strategy:
    """One layer's tensor-parallel schedule, its sub-batch count and its remat policy."""

    schedule: str = "megatron"
    sub_batches: int = 1
    remat: str = "none"

    def label(self) -> str:
        sb = f"/{self.sub_batches}" if self.schedule in SUB_BATCH else ""
        return f"{self.schedule}{sb}+{self.remat}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# Costs of single operations.


@dataclasses.dataclass(frozen=True)
class Hardware:
    """Prices for one cluster: datasheet numbers, overridden by a calibration profile where it
    has them (`planner.profile.Profile`)."""

    cluster: ClusterSpec
    profile: object | None = None  # planner.profile.Profile
    async_collectives: bool = True

    @classmethod
    def of(cls, cluster: ClusterSpec, profile=None) -> Hardware:
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


def elem_bytes(cfg: ModelConfig) -> int:
    """Bytes per activation element in the compute dtype."""
    return jnp.dtype(cfg.dtype).itemsize


def tensor_group(layout: Layout) -> list[int]:
    """Device ids of one tensor group: the innermost (contiguous) mesh axis."""
    return list(range(layout.tensor))


def replica_group(layout: Layout) -> list[int]:
    """Device ids of one data(+fsdp) group: strided by the tensor size."""
    return [i * layout.tensor for i in range(layout.replicas)]


# The two-stream replay.

Op = tuple  # ("c", seconds) | ("start", key, seconds) | ("done", key) | ("sync",)


def replay(ops: Sequence[Op], *, overlap: bool = True) -> tuple[float, float, float]:
    """(time, compute, comm) of an op list under the two-stream rules in the module docstring.
    ("sync",) waits for every collective in flight. Without `overlap` (synchronous
    collectives) every collective runs alone at its start."""
    tc = tm = compute = comm = 0.0
    pending: dict = {}
    for op in ops:
        if op[0] == "c":
            tc += op[1]
            compute += op[1]
        elif op[0] == "sync":
            tc = max([tc, *pending.values()])
            pending.clear()
        elif op[0] == "start":
            comm += op[2]
            begin = max(tc, tm)
            tm = begin + op[2]
            if overlap:
                pending[op[1]] = tm
            else:
                tc = tm
        else:
            tc = max(tc, pending.pop(op[1], tc))
    for end in pending.values():
        tc = max(tc, end)
    return max(tc, tm), compute, comm


# One layer.


@dataclasses.dataclass(frozen=True)
class SubLayerWork:
    """Seconds of the parts of one residual sub-layer (attention or MLP) for `rows` rows."""

    pre: float  # norm (+ residual add) memory work
    col: float  # column-parallel GEMM(s), forward
    core: float  # between the projections: attention scores/softmax/PV, or the activation
    row: float  # row-parallel GEMM, forward
    col_bytes: float  # bytes of the column projection's (full, per-replica) input activation


class LayerModel:
    """Costs of one transformer layer under one layout and strategy."""

    def __init__(self, cfg: ModelConfig, layout: Layout, hw: Hardware):
        self.cfg, self.layout, self.hw = cfg, layout, hw
        self.e = elem_bytes(cfg)
        self.tgroup = tensor_group(layout)
        # cuDNN's fused attention keeps the scores on chip: no softmax passes, nothing saved.
        self.flash = cfg.flash_attention(on_gpu=hw.cluster.device_spec.fused_attention)
        self._step_extra = 0.0

    # Work.
    def sublayers(self, rows: int, strategy: Strategy, chunks: int = 1) -> dict[str, SubLayerWork]:
        """Forward work of attention and MLP for `rows` rows on one device.

        With T = rows * seq tokens, t = tensor degree and e bytes per element:
          QKV  2 T D (H + 2G) K / t FLOPs     out proj   2 T H K D / t
          attn 4 T L H K / t FLOPs (scores + PV) and T L H / t (4 + 4 + e) bytes of softmax
               (no softmax bytes under fused flash attention, `ModelConfig.flash_attention`)
          MLP  2 T D F (2 or 3) / t FLOPs and an activation pass of T F / t (2 or 3) e bytes
          norm + residual  5 T D e / s bytes (s = t under sequence parallelism)
        """
        c, t, e = self.cfg, self.layout.tensor, self.e
        seq = self.layout.seq_len
        tok = rows * seq
        d, h, g, k, f = c.d_model, c.n_heads, c.kv_heads, c.k_dim, c.ff_dim
        s = t if strategy.schedule in SEQUENCE_PARALLEL else 1
        hw, dt = self.hw, c.dtype
        gated = 3 if c.gated_mlp else 2

        def gemm(m, kk, n):
            return hw.gemm_s(2.0 * m * kk * n, e * (m * kk + kk * n + m * n), dt, chunks)

        pre = hw.mem_s(5 * tok * d * e / s)
        attn = SubLayerWork(
            pre=pre,
            col=gemm(tok, d, (h + 2 * g) * k / t),
            core=gemm(rows * h / t * seq, k, seq) + gemm(rows * h / t * seq, seq, k)
            + (0.0 if self.flash else hw.mem_s(tok * seq * h / t * (8 + e))),
            row=gemm(tok, h * k / t, d),
            col_bytes=tok * d * e,
        )
        mlp = SubLayerWork(
            pre=pre,
            col=gemm(tok, d, f * (gated - 1) / t),
            core=hw.mem_s(tok * f / t * (gated + 1) * e / 1),
            row=gemm(tok, f / t, d),
            col_bytes=tok * d * e,
        )
        return {"attn": attn, "mlp": mlp}

    # Op lists.
    def layer_ops(self, strategy: Strategy) -> dict[str, list[Op]]:
        """Forward, backward and recomputation of one layer (one micro-batch) as op lists.

        Backward of each sub-layer: 2x its forward GEMMs (dX and dW), the memory work twice.
        Recomputation (remat): `full` redoes the forward, collectives included; `save_proj`
        keeps the values on both sides of every collective, so it redoes the forward compute
        minus the row projections (minus the column ones too under ring schedules) and issues
        no collective.
        """
        if self.layout.primepar or strategy.schedule == "primepar":
            return self._square().layer_ops(strategy)
        sch, t = strategy.schedule, self.layout.tensor
        k = strategy.sub_batches if sch in SUB_BATCH else 1
        rows = self.layout.rows
        if t == 1:
            sch = "none"
        elif rows % k:
            raise ValueError(f"{rows} rows do not split into {k} sub-batches")
        ring = sch in RING
        work = self.sublayers(rows // k, strategy, chunks=t if ring else 1)
        # Overheads that are memory traffic: the schedule's extra passes and the scan's
        # stacking of saved activations. Ring schedules spend theirs inside the ring steps
        # (slicing, accumulating and placing chunks); the others split and join sub-batches
        # outside the overlapped region, half before and half after its collectives.
        tok_bytes = rows * self.layout.seq_len * self.cfg.d_model * self.e
        extra = self.hw.mem_s(SCHEDULE_PASSES[sch] * tok_bytes)
        scan = self.hw.mem_s(SCAN_PASSES * self.saved_bytes(strategy)) \
            if self.cfg.scan_layers else 0.0
        # 2 rings per sub-layer forward and 2 backward, t steps each, 2k sub-layers.
        self._step_extra = extra / (8 * k * t) if ring else 0.0
        outer = 0.0 if ring else extra
        fwd, bwd = [], []
        order = [(op, j) for op in ("attn", "mlp") for j in range(k)]
        for idx, (name, j) in enumerate(order):
            fwd += self._fwd(sch, work[name], f"{name}{j}", prev=self._prev(order, idx, "f"))
        rorder = order[::-1]
        for idx, (name, j) in enumerate(rorder):
            bwd += self._bwd(sch, work[name], f"b{name}{j}", prev=self._prev(rorder, idx, "b"))
        recompute = self._recompute(strategy, sch, work, k)
        fwd = [("c", outer / 6 + scan / 2)] + fwd + [("sync",), ("c", outer / 6)]
        bwd = [("c", outer / 3 + scan / 2)] + bwd + [("sync",), ("c", outer / 3)]
        return {"fwd": fwd, "bwd": bwd, "recompute": recompute}

    @staticmethod
    def _prev(order, idx, tag) -> str | None:
        """The collective this step must wait for: the previous step of the same sub-batch."""
        j = order[idx][1]
        for name, jj in reversed(order[:idx]):
            if jj == j:
                return f"{'' if tag == 'f' else 'b'}{name}{jj}"
        return None

    def _ar(self, nbytes):
        return self.hw.comm_s("all-reduce", nbytes, self.tgroup)

    def _ag(self, nbytes):
        return self.hw.comm_s("all-gather", nbytes, self.tgroup)

    def _rs(self, nbytes):
        return self.hw.comm_s("reduce-scatter", nbytes, self.tgroup)

    def _perm(self, nbytes):
        return self.hw.comm_s("collective-permute", nbytes, [0, 1] if self.layout.tensor > 1
                              else [0])

    def _ring(self, key, step_compute: float, nbytes_step: float, transfers: int = 1) -> list:
        """A ring over t devices: t steps of `step_compute`, each of the first t - 1 issuing
        `transfers` permutes of `nbytes_step` before its compute (rings: max(step GEMM, step
        transfer) per step)."""
        t = self.layout.tensor
        ops = []
        for i in range(t):
            if i < t - 1:
                for r in range(transfers):
                    ops.append(("start", f"{key}.{i}.{r}", self._perm(nbytes_step)))
            ops.append(("c", step_compute + self._step_extra))
            if i < t - 1:
                for r in range(transfers):
                    ops.append(("done", f"{key}.{i}.{r}"))
        return ops

    def _fwd(self, sch, w: SubLayerWork, key, prev) -> list[Op]:
        a, t = w.col_bytes, self.layout.tensor
        wait = [("done", prev)] if prev else []
        if sch in ("none",):
            return [("c", w.pre + w.col + w.core + w.row)]
        if sch in ("megatron",):
            return [("c", w.pre + w.col + w.core + w.row), ("start", key, self._ar(a)),
                    ("done", key)]
        if sch == "oases":  # the collective waits until the same sub-batch's next step
            return wait + [("c", w.pre + w.col + w.core + w.row), ("start", key, self._ar(a))]
        if sch == "megatron_sp":
            return [("c", w.pre), ("start", key + "g", self._ag(a)), ("done", key + "g"),
                    ("c", w.col + w.core + w.row), ("start", key, self._rs(a)), ("done", key)]
        # Rings: all-gather-matmul, the core, matmul-reduce-scatter.
        ops = wait + [("c", w.pre)]
        ops += self._ring(key + "g", w.col / t, a / t)
        ops += [("c", w.core)]
        ops += self._ring(key + "r", w.row / t, a / t)
        return ops

    def _bwd(self, sch, w: SubLayerWork, key, prev) -> list[Op]:
        a, t = w.col_bytes, self.layout.tensor
        wait = [("done", prev)] if prev else []
        # dX and dW of each projection: one GEMM each of the forward's size.
        if sch == "none":
            return [("c", 2 * (w.pre + w.core) + 2 * w.row + 2 * w.col)]
        if sch == "megatron":  # dX all-reduce hides behind the column projection's dW
            return [("c", 2 * w.row + 2 * w.core + w.col), ("start", key, self._ar(a)),
                    ("c", w.col), ("done", key), ("c", 2 * w.pre)]
        if sch == "oases":
            return wait + [("c", 2 * w.row + 2 * w.core + w.col), ("start", key, self._ar(a)),
                           ("c", w.col + 2 * w.pre)]
        if sch == "megatron_sp":  # all-gather of dY, then reduce-scatter of dX behind dW
            return [("start", key + "g", self._ag(a)), ("done", key + "g"),
                    ("c", 2 * w.row + 2 * w.core + w.col), ("start", key, self._rs(a)),
                    ("c", w.col), ("done", key), ("c", 2 * w.pre)]
        # Rings: the row projection's backward gathers dY around a ring (dX and dW per step);
        # the column projection's reduce-scatters dX while re-gathering X for dW (2 permutes).
        ops = wait + self._ring(key + "r", 2 * w.row / t, a / t)
        ops += [("c", 2 * w.core)]
        ops += self._ring(key + "g", 2 * w.col / t, a / t, transfers=2)
        ops += [("c", 2 * w.pre)]
        return ops

    def _recompute(self, strategy: Strategy, sch, work, k) -> list[Op]:
        if strategy.remat == "none":
            return []
        if strategy.remat == "full":
            order = [(op, j) for op in ("attn", "mlp") for j in range(k)]
            ops = []
            for idx, (name, j) in enumerate(order):
                ops += self._fwd(sch, work[name], f"r{name}{j}",
                                 prev=("r" + self._prev(order, idx, "f"))
                                 if self._prev(order, idx, "f") else None)
            return ops
        # save_proj: compute-only, no collective.
        total = 0.0
        for _ in range(k):
            for w in work.values():
                total += w.pre + w.core + (0.0 if sch in RING else w.col)
        return [("c", total)]

    def time(self, strategy: Strategy) -> LayerCost:
        ops = self.layer_ops(strategy)
        ov = self.hw.async_collectives
        parts = {name: replay(o, overlap=ov) for name, o in ops.items()}
        # Recomputation runs right before the layer's backward: one op list.
        bwd = replay(ops["recompute"] + ops["bwd"], overlap=ov)
        fwd = parts["fwd"]
        return LayerCost(
            fwd_s=fwd[0], bwd_s=bwd[0], compute_s=fwd[1] + bwd[1], comm_s=fwd[2] + bwd[2],
            act_bytes=self.saved_bytes(strategy), temp_bytes=self.temp_bytes(strategy))

    def _square(self):
        """PrimePar's costs (`planner.primepar_cost`): its own op lists and memory."""
        from planner.primepar_cost import Square

        return Square(self)

    # Memory.
    def saved_bytes(self, strategy: Strategy) -> float:
        """Activations one layer keeps for its backward (one micro-batch), bytes per device.

        With T tokens on this device, s = t under sequence parallelism (else 1):
          none:      residual inputs 2 T D / s, normed inputs 2 T D, QKV T (H + 2G) K / t,
                     attention output T H K / t, probabilities T L H / t, MLP hidden
                     (2 or 3) T F / t, all at e bytes, plus three f32 copies of the scores
                     T L H / t (the scores, their masked form and the softmax, as XLA keeps
                     them); under flash attention neither, but f32 softmax statistics T H / t
          save_proj: the layer input T D / s and the four saved projections 4 T D / s
                     (+ QKV and MLP hidden under ring schedules)
          full:      the layer input T D / s
        """
        if self.layout.primepar or strategy.schedule == "primepar":
            return self._square().saved_bytes(strategy)
        c, t, e = self.cfg, self.layout.tensor, self.e
        sch = strategy.schedule if t > 1 else "none"
        s = t if sch in SEQUENCE_PARALLEL else 1
        tok = self.layout.rows * self.layout.seq_len
        d, h, g, k, f = c.d_model, c.n_heads, c.kv_heads, c.k_dim, c.ff_dim
        gated = 3 if c.gated_mlp else 2
        qkv = tok * (h + 2 * g) * k / t
        hidden = gated * tok * f / t
        if strategy.remat == "full":
            return tok * d / s * e
        if strategy.remat == "save_proj":
            extra = (qkv + hidden / gated * (gated - 1)) if sch in RING else 0.0
            return (tok * d / s + 4 * tok * d / s + extra) * e
        base = (2 * tok * d / s + 2 * tok * d + qkv + tok * h * k / t + hidden) * e
        if self.flash:
            return base + 4 * tok * h / t
        scores = tok * self.layout.seq_len * h / t
        return base + scores * e + 3 * 4 * scores

    def temp_bytes(self, strategy: Strategy) -> float:
        """Working set beyond the saved activations while a layer runs its backward: the
        recomputed activations (for remat) plus the f32 score and gradient buffers (none under
        flash attention), and the ring schedules' chunk buffers (two chunks in flight)."""
        if self.layout.primepar or strategy.schedule == "primepar":
            return self._square().temp_bytes(strategy)
        c, t, e = self.cfg, self.layout.tensor, self.e
        tok = self.layout.rows * self.layout.seq_len
        scores = tok * self.layout.seq_len * c.n_heads / t
        k = strategy.sub_batches if strategy.schedule in SUB_BATCH else 1
        full = self.saved_bytes(dataclasses.replace(strategy, remat="none"))
        temp = 0.0 if self.flash else 2 * 4 * scores / k
        if strategy.remat != "none":
            temp += full
        if strategy.schedule in RING and t > 1:
            temp += 2 * 2 * tok * c.d_model * e / t
        return temp



@dataclasses.dataclass(frozen=True)
class LayerCost:
    fwd_s: float
    bwd_s: float  # recomputation included
    compute_s: float
    comm_s: float
    act_bytes: float  # saved for the backward, per micro-batch in flight
    temp_bytes: float  # working set of the layer's backward

    @property
    def step_s(self) -> float:
        return self.fwd_s + self.bwd_s


def resharding_s(a: Strategy, b: Strategy, cfg: ModelConfig, layout: Layout,
                 hw: Hardware) -> float:
    """Moving the residual stream (T D e bytes per replica) between consecutive layers whose
    layouts differ: sequence-sharded -> replicated is an all-gather, the reverse a local slice
    (free); forward and backward (the backward of an all-gather is a reduce-scatter)."""
    if layout.tensor == 1:
        return 0.0
    sa, sb = a.schedule in SEQUENCE_PARALLEL, b.schedule in SEQUENCE_PARALLEL
    if sa == sb or not sa:
        return 0.0
    e = elem_bytes(cfg)
    nbytes = layout.rows * layout.seq_len * cfg.d_model * e
    g = tensor_group(layout)
    return hw.comm_s("all-gather", nbytes, g) + hw.comm_s("reduce-scatter", nbytes, g)


# The whole step.


@dataclasses.dataclass(frozen=True)
class StepCost:
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    dp_reduce_s: float
    peak_memory_bytes: float
    memory: dict[str, float]


def static_memory(cfg: ModelConfig, layout: Layout) -> dict[str, float]:
    """Parameters, gradients and AdamW moments per device (fp32 each), sharded over tensor
    (the block matrices and the vocabulary) and fsdp; plus a gradient accumulator with more
    than one micro-batch.

      params_local = (L * P_block + V D) / (t * f)   (norms and biases counted as sharded)
    """
    blocks = cfg.param_count(embeddings=False)
    emb = cfg.param_count() - blocks
    local = (blocks + emb) / (layout.tensor * layout.fsdp)
    mem = {"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local}
    if layout.microbatches > 1:
        mem["grad_accumulator"] = 4 * local
    return mem


def head_cost(cfg: ModelConfig, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(seconds, temp bytes) of the embedding, logits and loss for one micro-batch, forward and
    backward: 6 T D V / t FLOPs and `LOGIT_PASSES` passes over T V / t f32 logits; with a
    vocabulary split over t devices plus `head_tensor_comm_s`; under primepar instead the
    gathers and all-reduces of `planner.primepar_cost.head_extra`."""
    e = elem_bytes(cfg)
    tok = layout.rows * layout.seq_len
    v = cfg.padded_vocab / layout.tensor
    flops = 6.0 * tok * cfg.d_model * v
    nbytes = 3 * e * (tok * cfg.d_model + cfg.d_model * v + tok * v)
    logits = tok * v * 4
    t = hw.gemm_s(flops, nbytes, cfg.dtype) \
        + hw.mem_s(LOGIT_PASSES * logits + 3 * tok * cfg.d_model * e)
    if layout.primepar:
        from planner.primepar_cost import head_extra

        extra_s, extra_temp = head_extra(cfg, layout, hw)
        return t + extra_s, 3 * logits + extra_temp
    return t + head_tensor_comm_s(cfg, layout, hw), 3 * logits


def head_tensor_comm_s(cfg: ModelConfig, layout: Layout, hw: Hardware) -> float:
    """The vocabulary-parallel head's collectives over the tensor group, all exposed (nothing
    independent runs beside them): the embedding lookup's all-reduce of T D activations and,
    in the backward, the all-reduce of the hidden state's gradient from the tied logits
    projection; the cross-entropy's three all-reduces of T f32 values (max, sum of
    exponentials, the label's logit)."""
    if layout.tensor == 1 or layout.primepar:
        return 0.0
    tok = layout.rows * layout.seq_len
    g = tensor_group(layout)
    return 2 * hw.comm_s("all-reduce", tok * cfg.d_model * elem_bytes(cfg), g) \
        + 3 * hw.comm_s("all-reduce", tok * 4, g)


def step_cost(cfg: ModelConfig, layout: Layout, strategies: Sequence[Strategy], hw: Hardware,
              layer_costs: dict[Strategy, LayerCost] | None = None) -> StepCost:
    """One optimizer step: `microbatches` x (head + every layer's forward and backward, plus
    resharding between differing neighbours), then the data-parallel gradient reduction and
    the AdamW update.

    Data-parallel reduction (all-reduce of the local fp32 gradients over data x fsdp; for
    fsdp a reduce-scatter plus the parameter all-gathers of forward and backward) runs after
    the layer loop, so only the embedding/head backward hides it:
        exposed = max(0, reduce - head backward)
    Optimizer: 7 fp32 passes over the local parameters at HBM bandwidth.
    """
    if layer_costs is None:
        lm = LayerModel(cfg, layout, hw)
        layer_costs = {s: lm.time(s) for s in set(strategies)}
    m = layout.microbatches
    layers = sum(layer_costs[s].step_s for s in strategies)
    pairs = zip(strategies, strategies[1:], strict=False)
    reshard = sum(resharding_s(a, b, cfg, layout, hw) for a, b in pairs)
    head_s, head_temp = head_cost(cfg, layout, hw)
    static = static_memory(cfg, layout)
    local_params = static["params"] / 4
    rgroup = replica_group(layout)
    grad_bytes = 4 * local_params
    if layout.fsdp > 1:
        # Parameters gathered for forward and backward, gradients reduce-scattered (per micro
        # step), then an all-reduce over the data axis of the fsdp-sharded gradients.
        gathered = grad_bytes * layout.fsdp
        fgroup = [i * layout.tensor for i in range(layout.fsdp)]
        dgroup = [i * layout.tensor * layout.fsdp for i in range(layout.data)]
        per_micro = 2 * hw.comm_s("all-gather", gathered, fgroup) \
            + hw.comm_s("reduce-scatter", gathered, fgroup)
        reduce = hw.comm_s("all-reduce", grad_bytes, dgroup)
        fsdp_s = m * per_micro
    else:
        reduce = hw.comm_s("all-reduce", grad_bytes, rgroup)
        fsdp_s = 0.0
    hidden = min(reduce, 0.5 * head_s) if hw.async_collectives else 0.0
    exposed_reduce = reduce - hidden
    opt_s = hw.mem_s(OPTIMIZER_PASSES * 4 * local_params)
    accum_s = hw.mem_s(3 * 4 * local_params) * (m if m > 1 else 0)
    step = m * (layers + reshard + head_s) + fsdp_s + exposed_reduce + opt_s + accum_s
    compute = m * (sum(layer_costs[s].compute_s for s in strategies) + head_s) + opt_s + accum_s
    comm = m * (sum(layer_costs[s].comm_s for s in strategies) + reshard) + reduce + fsdp_s
    acts = sum(layer_costs[s].act_bytes for s in strategies)
    temp = max(max(layer_costs[s].temp_bytes for s in strategies), head_temp)
    memory = {**static, "activations": acts, "temporaries": temp}
    return StepCost(step_s=step, compute_s=compute, comm_s=comm,
                    exposed_comm_s=max(step - compute, 0.0), dp_reduce_s=reduce,
                    peak_memory_bytes=sum(memory.values()), memory=memory)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
