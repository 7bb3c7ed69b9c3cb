"""One layer's cost under one layout and strategy: the Megatron family's forward, backward and
recomputation as op lists (`LayerModel.layer_ops`), in the order our implementation issues them,
priced by the two-stream replay (`oases_jax.streams`), and the activations it keeps. Primepar's
layers are handed to `planner.cost.primepar_cost.Square`.

Compute ops cost the roofline max(FLOPs / peak, bytes / HBM bandwidth) (or a calibration
profile's fitted GEMM time), and collectives the alpha-beta model of
`oases_jax.hardware.collective_time` (or the profile's fit): `planner.cost.prices`.
"""

from __future__ import annotations

import dataclasses

from oases_jax import registry
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner.cost.layer_work import (
    SCAN_PASSES,
    SCHEDULE_PASSES,
    WEIGHT_SLICE_PASSES,
    LayerWork,
    SubLayerWork,
    sequence_split,
)
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.primepar_cost import Square
from oases_jax.planner.layout import Layout
from oases_jax.streams import Op, replay


@dataclasses.dataclass(frozen=True)
class LayerCost:
    fwd_s: float
    bwd_s: float  # recomputation included
    compute_s: float
    comm_s: float
    act_bytes: float  # saved for the backward, per micro-batch in flight
    temp_bytes: float  # working set of the layer's backward
    # One saved f32 score tensor (one sub-batch's), which XLA re-lays out for the backward loop
    # as a whole stack of the layers that run alike (`step_cost.score_relayout_bytes`).
    score_copy_bytes: float = 0.0

    @property
    def step_s(self) -> float:
        return self.fwd_s + self.bwd_s


def comm_pattern(schedule: str) -> str:
    """How a sub-layer of `schedule` ("none": a layer without a tensor split) communicates, read
    off its registry record:
      ring            every projection a ppermute ring (`rings`)
      gather_scatter  all-gather before the column projection, reduce-scatter after the row
                      one (`sequence_parallel`)
      seq_deferred    gather_scatter on sub-batches: a sub-layer's k all-gathers issued
                      together, each step's reduce-scatter left running beside the next step's
                      compute (`sequence_parallel` and `sub_batches`)
      deferred        an all-reduce after the row projection that the same sub-batch's next
                      step waits for (`sub_batches`)
      all_reduce      an all-reduce after the row projection (Megatron)
    """
    if schedule == "none":
        return "none"
    spec = registry.get(schedule)
    if spec.rings:
        return "ring"
    if spec.sequence_parallel:
        return "seq_deferred" if spec.sub_batches else "gather_scatter"
    return "deferred" if spec.sub_batches else "all_reduce"


class LayerModel(LayerWork):
    """Costs of one transformer layer under one layout and strategy."""

    def __init__(self, cfg: ModelConfig, layout: Layout, hw: Hardware, *,
                 gathered_stack: bool = False):
        super().__init__(cfg, layout, hw, gathered_stack=gathered_stack)
        self._step_extra = 0.0

    # Op lists.
    def layer_ops(self, strategy: LayerSpec) -> dict[str, list[Op]]:
        """Forward, backward and recomputation of one layer (one micro-batch) as op lists.

        Backward of each sub-layer: 2x its forward GEMMs (dX and dW), the memory work twice.
        Recomputation (remat): `full` redoes the forward, collectives included; `save_proj`
        keeps the values on both sides of every collective, so it redoes the forward compute
        minus the row projections (minus the column ones too under ring schedules) and issues
        no collective.
        """
        if self.layout.primepar or strategy.spec.square:
            return Square(self).layer_ops(strategy)
        sch, t = strategy.schedule, self.layout.tensor
        k = strategy.spec.layer_sub_batches(strategy.sub_batches)
        rows = self.layout.rows
        if t == 1:
            sch = "none"
        elif rows % k:
            raise ValueError(f"{rows} rows do not split into {k} sub-batches")
        pattern = comm_pattern(sch)
        ring = pattern == "ring"
        work = self.sublayers(rows // k, strategy, chunks=t if ring else 1)
        # Overheads that are memory traffic: the schedule's extra passes and the scan's
        # stacking of saved activations. Ring schedules spend theirs inside the ring steps
        # (slicing, accumulating and placing chunks); the others split and join sub-batches
        # outside the overlapped region, half before and half after its collectives.
        tok_bytes = rows * self.layout.seq_len * self.cfg.d_model * self.e
        extra = self.hw.mem_s(SCHEDULE_PASSES[sch] * tok_bytes)
        scan = slices = 0.0
        if self.cfg.scan_layers:
            scan = self.hw.mem_s(SCAN_PASSES * self.saved_bytes(strategy))
            slices = self.hw.mem_s(WEIGHT_SLICE_PASSES * self.weight_bytes())
        # 2 rings per sub-layer forward and 2 backward, t steps each, 2k sub-layers.
        self._step_extra = extra / (8 * k * t) if ring else 0.0
        outer = 0.0 if ring else extra
        fwd, bwd = [], []
        order = [(op, j) for op in ("attn", "mlp") for j in range(k)]
        if pattern == "seq_deferred":
            fwd += self._fwd_seq(work, k)
        for idx, (name, j) in enumerate(order if pattern != "seq_deferred" else ()):
            fwd += self._fwd(pattern, work[name], f"{name}{j}", prev=self._prev(order, idx, "f"))
        rorder = order[::-1]
        if pattern in ("deferred", "seq_deferred"):
            bwd += self._bwd_tied(work, k, seq=pattern == "seq_deferred")
        else:
            for idx, (name, j) in enumerate(rorder):
                bwd += self._bwd(pattern, work[name], f"b{name}{j}",
                                 prev=self._prev(rorder, idx, "b"))
        recompute = self._recompute(strategy, pattern, work, k)
        # The forward slices its weights once (2 of the 6 passes), the backward slices them and
        # writes their gradients.
        fwd = [("c", outer / 6 + scan / 2 + slices / 3)] + fwd + [("sync",), ("c", outer / 6)]
        bwd = [("c", outer / 3 + scan / 2 + 2 * slices / 3)] + bwd \
            + [("sync",), ("c", outer / 3)]
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
        """One ring step: every device passes its block to a neighbour at once, so the step
        lasts as long as the slowest hop of the ring, the link the whole tensor group crosses
        (a tensor group spanning two nodes waits on the inter-node link at every step)."""
        return self.hw.comm_s("collective-permute", nbytes, self.tgroup if self.layout.tensor > 1
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

    def _fwd(self, pattern, w: SubLayerWork, key, prev) -> list[Op]:
        a, t = w.col_bytes, self.layout.tensor
        wait = [("done", prev)] if prev else []
        if pattern == "none":
            return [("c", w.pre + w.col + w.core + w.row)]
        if pattern == "all_reduce":
            return [("c", w.pre + w.col + w.core + w.row), ("start", key, self._ar(a)),
                    ("done", key)]
        if pattern == "deferred":  # the collective waits until the same sub-batch's next step
            return wait + [("c", w.pre + w.col + w.core + w.row), ("start", key, self._ar(a))]
        if pattern == "gather_scatter":
            return [("c", w.pre), ("start", key + "g", self._ag(a)), ("done", key + "g"),
                    ("c", w.col + w.core + w.row), ("start", key, self._rs(a)), ("done", key)]
        # Rings: all-gather-matmul, the core, matmul-reduce-scatter.
        ops = wait + [("c", w.pre)]
        ops += self._ring(key + "g", w.col / t, a / t)
        ops += [("c", w.core)]
        ops += self._ring(key + "r", w.row / t, a / t)
        return ops

    def _fwd_seq(self, work, k, tag: str = "") -> list[Op]:
        """oases_sp's forward as the compiled program runs it (`projections.LocalSeqOrdered`):
        per sub-layer, once the previous sub-layer's last reduce-scatter is done, the k norms and
        the k all-gathers issued together (every sub-batch's input is ready); then per
        sub-batch its column GEMMs and core once its gather is done, the previous step's
        reduce-scatter waited for before its row GEMM, its own left running."""
        ops: list[Op] = []
        last = None
        for name in ("attn", "mlp"):
            w = work[name]
            ops += ([("done", last)] if last else []) + [("c", k * w.pre)]
            ops += [("start", f"{tag}{name}{j}g", self._ag(w.col_bytes)) for j in range(k)]
            for j in range(k):
                ops += [("done", f"{tag}{name}{j}g"), ("c", w.col + w.core)]
                ops += ([("done", last)] if last else []) + [("c", w.row)]
                last = f"{tag}{name}{j}"
                ops.append(("start", last, self._rs(w.col_bytes)))
        return ops

    def _bwd(self, pattern, w: SubLayerWork, key, prev) -> list[Op]:
        a, t = w.col_bytes, self.layout.tensor
        wait = [("done", prev)] if prev else []
        # dX and dW of each projection: one GEMM each of the forward's size.
        if pattern == "none":
            return [("c", 2 * w.pre + w.core_bwd + 2 * w.row + 2 * w.col)]
        if pattern == "all_reduce":  # dX all-reduce hides behind the column projection's dW
            return [("c", 2 * w.row + w.core_bwd + w.col), ("start", key, self._ar(a)),
                    ("c", w.col), ("done", key), ("c", 2 * w.pre)]
        if pattern == "gather_scatter":  # all-gather of dY, then reduce-scatter of dX behind dW
            return [("start", key + "g", self._ag(a)), ("done", key + "g"),
                    ("c", 2 * w.row + w.core_bwd + w.col), ("start", key, self._rs(a)),
                    ("c", w.col), ("done", key), ("c", 2 * w.pre)]
        # Rings: the row projection's backward gathers dY around a ring (dX and dW per step);
        # the column projection's reduce-scatters dX while re-gathering X for dW (2 permutes).
        ops = wait + self._ring(key + "r", 2 * w.row / t, a / t)
        ops += [("c", w.core_bwd)]
        ops += self._ring(key + "g", 2 * w.col / t, a / t, transfers=2)
        ops += [("c", 2 * w.pre)]
        return ops

    def _bwd_tied(self, work, k, seq: bool = False) -> list[Op]:
        """Oases' backward as the compiled program runs it: the forward's steps reversed
        (mlp(k-1) .. mlp(0), attn(k-1) .. attn(0)), each step's dX all-reduce issued once its dX
        partial is computed and covered by its own column dW GEMM and the next step's backward
        up to its dX (`step_order.tie_backward` starts the next step only after this one's dX
        partial), the norm's backward after the all-reduce. Before the tie, XLA ran every
        sub-batch's work up to its dX and then the k all-reduces back to back.

        `seq` (oases_sp): the dX collective is a reduce-scatter, and each step first
        all-gathers its output's gradient dY, issued as soon as dY exists: at once for the MLP
        steps (the layer's output gradient), after the same sub-batch's MLP norm backward for
        the attention steps."""
        ops: list[Op] = []
        prev = None
        dx = self._rs if seq else self._ar
        if seq:
            ops += [("start", f"gmlp{j}", self._ag(work["mlp"].col_bytes))
                    for j in reversed(range(k))]
        for name in ("mlp", "attn"):
            w = work[name]
            for j in reversed(range(k)):
                ops += [("done", f"g{name}{j}")] if seq else []
                ops.append(("c", 2 * w.row + w.core_bwd + w.col))
                if prev:
                    ops += [("done", prev[0]), ("c", 2 * prev[1].pre)]
                    if seq and prev[2] == "mlp":
                        ops.append(("start", f"gattn{prev[3]}",
                                    self._ag(work["attn"].col_bytes)))
                key = f"b{name}{j}"
                ops += [("start", key, dx(w.col_bytes)), ("c", w.col)]
                prev = (key, w, name, j)
        return ops + [("done", prev[0]), ("c", 2 * prev[1].pre)]

    def _recompute(self, strategy: LayerSpec, pattern, work, k) -> list[Op]:
        if strategy.remat == "none":
            return []
        if strategy.remat == "full":
            if pattern == "seq_deferred":
                return self._fwd_seq(work, k, tag="r")
            order = [(op, j) for op in ("attn", "mlp") for j in range(k)]
            ops = []
            for idx, (name, j) in enumerate(order):
                ops += self._fwd(pattern, work[name], f"r{name}{j}",
                                 prev=("r" + self._prev(order, idx, "f"))
                                 if self._prev(order, idx, "f") else None)
            return ops
        # save_proj: compute-only, no collective.
        total = 0.0
        for _ in range(k):
            for w in work.values():
                total += w.pre + w.core + (0.0 if pattern == "ring" else w.col)
        return [("c", total)]

    def time(self, strategy: LayerSpec) -> LayerCost:
        ops = self.layer_ops(strategy)
        ov = self.hw.async_collectives
        parts = {name: replay(o, overlap=ov) for name, o in ops.items()}
        # Recomputation runs right before the layer's backward: one op list.
        bwd = replay(ops["recompute"] + ops["bwd"], overlap=ov)
        fwd = parts["fwd"]
        return LayerCost(
            fwd_s=fwd[0], bwd_s=bwd[0], compute_s=fwd[1] + bwd[1], comm_s=fwd[2] + bwd[2],
            act_bytes=self.saved_bytes(strategy), temp_bytes=self.temp_bytes(strategy),
            score_copy_bytes=self.score_copy_bytes(strategy))

    # Memory.
    def saved_bytes(self, strategy: LayerSpec) -> float:
        """Activations one layer keeps for its backward (one micro-batch), bytes per device.

        With T tokens on this device, s = t under sequence parallelism (else 1):
          none:      residual inputs 2 T D / s, normed inputs 2 T D, QKV T (H + 2G) K / t,
                     attention output T H K / t, probabilities T L H / t, MLP hidden
                     (2 or 3) T F / t, all at e bytes, plus one f32 copy of the scores
                     T L H / t for the softmax's backward (per layer, 0.50 GiB compiled against
                     0.47 for oases-h2048-l24, fp32, tensor=4, 4 x 1024 on 3090:4; three f32
                     copies were counted before, 0.72); under flash attention neither, but f32
                     softmax statistics T H / t
          save_proj: the layer input T D / s and the four saved projections 4 T D / s
                     (+ QKV and MLP hidden where the column projection gathers: rings and
                     Megatron-SP)
          full:      the layer input T D / s
        """
        if self.layout.primepar or strategy.spec.square:
            return Square(self).saved_bytes(strategy)
        c, t, e = self.cfg, self.layout.tensor, self.e
        s = sequence_split(strategy.schedule, t)
        tok = self.layout.rows * self.layout.seq_len
        d, h, g, k, f = c.d_model, c.n_heads, c.kv_heads, c.k_dim, c.ff_dim
        gated = 3 if c.gated_mlp else 2
        qkv = tok * (h + 2 * g) * k / t
        hidden = gated * tok * f / t
        if strategy.remat == "full":
            return tok * d / s * e
        if strategy.remat == "save_proj":
            # Projections that gather inside the column projection (rings, Megatron-SP's
            # all-gather) keep its outputs too (`oases_jax.remat.policy`).
            spec = strategy.spec
            gathers = t > 1 and (spec.rings or spec.projection == "seq_parallel")
            extra = (qkv + hidden / gated * (gated - 1)) if gathers else 0.0
            return (tok * d / s + 4 * tok * d / s + extra) * e
        base = (2 * tok * d / s + 2 * tok * d + qkv + tok * h * k / t + hidden) * e
        if self.flash:
            return base + 4 * tok * h / t
        scores = tok * self.layout.seq_len * h / t
        return base + scores * e + 4 * scores

    def score_copy_bytes(self, strategy: LayerSpec) -> float:
        """One f32 score tensor a layer saves for its softmax's backward, per sub-batch (the
        layer saves one per sub-batch it runs): 4 T L H / (t k) (/ q^2 under primepar); none
        under flash attention or remat, which save no scores."""
        if self.flash or strategy.remat != "none":
            return 0.0
        if self.layout.primepar or strategy.spec.square:
            return Square(self).score_copy_bytes()
        tok = self.layout.rows * self.layout.seq_len
        k = strategy.spec.layer_sub_batches(strategy.sub_batches)
        return 4 * tok * self.layout.seq_len * self.cfg.n_heads / (self.layout.tensor * k)

    def temp_bytes(self, strategy: LayerSpec) -> float:
        """Working set beyond the saved activations while a layer runs its backward: the
        recomputed activations (for remat) plus the f32 score and gradient buffers (none under
        flash attention), and the ring schedules' chunk buffers (two chunks in flight). A layer
        recomputed whole (`full`) also holds its scores' masked and softmax f32 copies while its
        backward runs (oases-h4096-l16 fp32 on 3090:4, tensor=4: 4.07 GiB compiled for two
        layers, 3.47 predicted without them, 3.97 with)."""
        if self.layout.primepar or strategy.spec.square:
            return Square(self).temp_bytes(strategy)
        c, t, e = self.cfg, self.layout.tensor, self.e
        tok = self.layout.rows * self.layout.seq_len
        scores = tok * self.layout.seq_len * c.n_heads / t
        k = strategy.spec.layer_sub_batches(strategy.sub_batches)
        full = self.saved_bytes(dataclasses.replace(strategy, remat="none"))
        temp = 0.0 if self.flash else 2 * 4 * scores / k
        if strategy.remat != "none":
            temp += full
        if strategy.remat == "full" and not self.flash:
            temp += 2 * 4 * scores
        if strategy.spec.rings and t > 1:
            temp += 2 * 2 * tok * c.d_model * e / t
        return temp
