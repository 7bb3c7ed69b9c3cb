"""One layer's work on one device, before any schedule orders it: the seconds of each residual
sub-layer's norm, projections and core (`LayerWork.sublayers`), and the memory passes a compiled
layer spends beyond them (`SCAN_PASSES`, `SCHEDULE_PASSES`). Both layer cost models build on it:
`planner.cost.layer_cost` (the Megatron family) and `planner.cost.primepar_cost` (the square)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from oases_jax import registry
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout, tensor_group

# A scanned layer stack stores each layer's saved activations into stacked buffers: XLA
# initialises them, writes each layer's slice, and transposes them for the backward loop.
SCAN_PASSES = 4
# Memory passes over the layer's residual stream (T D e bytes) that a schedule's compiled
# layer spends beyond the roofline of its GEMMs, norms and softmax: splitting and joining
# sub-batches, the all-to-alls and transposes XLA inserts around sequence-sharded attention,
# and the ring schedules' chunk slicing, accumulation and concatenation. Calibrated from the
# compiled fwd+bwd of one `gpt2-1.5b` layer on h100:8, tensor=8 (docs/planner.md); "none" is a
# layer without a tensor split. Every planned schedule needs an entry (tests/planner); primepar's
# is not calibrated yet. oases_sp's is megatron_sp's plus its split's extra compute in the
# median of the three one-layer programs of `benchmarks/overlap_table.py` (+0.4, +0.6 and +8.6
# passes: GPT-2 1.5B flash at tensor=4, Llama-2 7B at tensor=8, GPT-2 1.5B materialised at 8).
SCHEDULE_PASSES = {"none": 0.0, "megatron": 4.0, "oases": 22.0, "megatron_sp": 22.0,
                   "oases_sp": 23.0, "collective_matmul": 74.0, "oases_cm": 115.0,
                   "primepar": 0.0}
# Sub-batch counts a schedule's SCHEDULE_PASSES hold for, where not every count the search
# offers: oases_sp's were fitted at k = 2, and at k = 4 its compiled layer spends more compute
# than they say (one GPT-2 1.5B layer, data=4,tensor=2, batch 16 x 1024 on h100:8: simulated
# compute 0.695 -> 0.737 ms from k = 2 to 4, priced flat; the 48-layer step 0.80 of its compile).
FITTED_SUB_BATCHES = {"oases_sp": (2,)}
# HBM passes of the MLP's activation over its hidden [T, F] (e bytes each), (forward, backward),
# by gated (SwiGLU) or not (GELU). Counted in the compiled bf16 steps of GPT-2 1.5B and Llama-2
# 7B on h100:1 (docs/planner.md, "One device: the passes outside the GEMMs"): the forward reads
# its inputs and writes its output (h -> a; gate, up -> a). The backward of GELU is one fusion
# that reads h and da and writes dh (a recompute of a for the down projection's weight gradient
# joins it); SwiGLU's reads gate, up and da, writes both input gradients and recomputes a. With
# a bias, its gradient is one more read of dh.
ACTIVATION_PASSES = {False: (2.0, 2.0), True: (3.0, 7.0)}
# A scanned stack slices each layer's weights out of the stacked arrays (a copy: read + write
# of the layer's compute-dtype weights) for the forward and again for the backward, and writes
# the layer's weight gradients into the stacked gradient (read + write): 6 passes over a layer's
# weights per step.
WEIGHT_SLICE_PASSES = 6.0


def weight_matrices(cfg: ModelConfig) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(attention, MLP) weight matrices of one layer in forward order, (name, parameters):
    Q, K, V and the output projection; the MLP's two (GELU) or three (SwiGLU) matrices."""
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k_dim, cfg.ff_dim
    attn = [("q", d * h * k), ("k", d * g * k), ("v", d * g * k), ("o", h * k * d)]
    mlp = [("gate", d * f), ("up", d * f), ("down", f * d)] if cfg.gated_mlp \
        else [("fc1", d * f), ("fc2", f * d)]
    return attn, mlp


def layer_matrices(cfg: ModelConfig) -> tuple[int, int]:
    """(attention, MLP) weight-matrix parameters of one layer (`weight_matrices` summed)."""
    attn, mlp = weight_matrices(cfg)
    return sum(p for _, p in attn), sum(p for _, p in mlp)


def elem_bytes(cfg: ModelConfig) -> int:
    """Bytes per activation element in the compute dtype."""
    return jnp.dtype(cfg.dtype).itemsize


def sequence_split(schedule: str, tensor: int) -> int:
    """s: how many ways a schedule splits the residual stream between blocks (the tensor degree
    for sequence-parallel schedules, else 1)."""
    return tensor if registry.get(schedule).sequence_parallel else 1


def stream_split(schedule: str, tensor: int, square: bool = False) -> int:
    """How many ways one device's rows x D of the residual stream are split inside a replica:
    `sequence_split`, or on primepar's q x q square (`square`) the rows over q and D over q."""
    return tensor if square else sequence_split(schedule, tensor)


def stream_bytes(cfg: ModelConfig, layout: Layout, schedule: str) -> float:
    """One micro-batch's residual stream on one device, T D e bytes over `stream_split`: what
    a stage sends its neighbour, and what a split head gathers."""
    return layout.rows * layout.seq_len * cfg.d_model * elem_bytes(cfg) \
        / stream_split(schedule, layout.tensor, layout.primepar)


@dataclasses.dataclass(frozen=True)
class SubLayerWork:
    """Seconds of the parts of one residual sub-layer (attention or MLP) for `rows` rows."""

    pre: float  # norm (+ residual add) memory work
    col: float  # column-parallel GEMM(s), forward
    core: float  # between the projections: attention scores/softmax/PV, or the activation
    row: float  # row-parallel GEMM, forward
    col_bytes: float  # bytes of the column projection's (full, per-replica) input activation
    core_bwd: float = -1.0  # the core's backward; < 0: twice its forward

    def __post_init__(self):
        if self.core_bwd < 0:
            object.__setattr__(self, "core_bwd", 2 * self.core)


class LayerWork:
    """One transformer layer of `cfg` on one device of `layout`, priced by `hw`."""

    def __init__(self, cfg: ModelConfig, layout: Layout, hw: Hardware, *,
                 gathered_stack: bool = False):
        self.cfg, self.layout, self.hw = cfg, layout, hw
        # Where the layer loop slices its weights from: the stack as stored (sharded over fsdp;
        # the gathers then write each layer's whole copy themselves) or, in a pipeline stage
        # under fsdp, the stage's stack gathered whole first (`gathered_stack`).
        self.stack_shards = 1 if gathered_stack else layout.fsdp
        self.e = elem_bytes(cfg)
        self.tgroup = tensor_group(layout)
        # cuDNN's fused attention keeps the scores on chip: no softmax passes, nothing saved.
        self.flash = cfg.flash_attention(on_gpu=hw.cluster.device_spec.fused_attention)

    def sublayers(self, rows: int, strategy: LayerSpec,
                  chunks: int = 1) -> dict[str, SubLayerWork]:
        """Forward work of attention and MLP for `rows` rows on one device.

        With T = rows * seq tokens, t = tensor degree and e bytes per element:
          QKV  2 T D (H + 2G) K / t FLOPs     out proj   2 T H K D / t
          attn 4 T L H K / t FLOPs (scores + PV) and T L H / t (4 + 4 + e) bytes of softmax;
               under fused flash attention (`ModelConfig.flash_attention`) cuDNN's causal
               kernel: half the FLOPs (the tiles above the diagonal are skipped), only Q, K, V
               and O through HBM, and a backward of 2.5 times the forward's FLOPs
               (`tools.analysis.attention.fused_attention_flops`, as the simulator prices it)
          MLP  2 T D F (2 or 3) / t FLOPs and the activation's ACTIVATION_PASSES over T F e / t
          norm + residual  5 T D e / s bytes (s = t under sequence parallelism)
        """
        c, t, e = self.cfg, self.layout.tensor, self.e
        seq = self.layout.seq_len
        tok = rows * seq
        d, h, g, k, f = c.d_model, c.n_heads, c.kv_heads, c.k_dim, c.ff_dim
        s = sequence_split(strategy.schedule, t)
        hw, dt = self.hw, c.dtype
        gated = 3 if c.gated_mlp else 2

        def gemm(m, kk, n, weights: bool = False):
            # A projection split into `chunks` ring steps reads its [kk, n] weights once per
            # step (each step multiplies one chunk of rows by all of them).
            reads = chunks if weights else 1
            return hw.gemm_s(2.0 * m * kk * n, e * (m * kk + reads * kk * n + m * n), dt,
                             chunks)

        pre = hw.mem_s(5 * tok * d * e / s)
        if self.flash:
            flops = 2.0 * tok * seq * h * k / t  # 4 T L H K, halved by the causal mask
            qkvo = e * tok * (2 * h + 2 * g) * k / t
            stats = 4.0 * tok * h / t
            core = hw.gemm_s(flops, qkvo + stats, dt, chunks)
            core_bwd = hw.gemm_s(2.5 * flops, 2 * qkvo + stats, dt, chunks)
        else:
            core = gemm(rows * h / t * seq, k, seq) + gemm(rows * h / t * seq, seq, k) \
                + hw.mem_s(tok * seq * h / t * (8 + e))
            core_bwd = 2 * core
        attn = SubLayerWork(pre=pre, col=gemm(tok, d, (h + 2 * g) * k / t, True), core=core,
                            row=gemm(tok, h * k / t, d, True), col_bytes=tok * d * e,
                            core_bwd=core_bwd)
        act_f, act_b = ACTIVATION_PASSES[c.gated_mlp]
        hidden = tok * f / t * e
        mlp = SubLayerWork(
            pre=pre,
            col=gemm(tok, d, f * (gated - 1) / t, True),
            core=hw.mem_s(act_f * hidden),
            row=gemm(tok, f / t, d, True),
            col_bytes=tok * d * e,
            core_bwd=hw.mem_s((act_b + (1 if c.use_bias else 0)) * hidden),
        )
        return {"attn": attn, "mlp": mlp}

    def weight_bytes(self) -> float:
        """Bytes of one layer's weight matrices on this device, in the compute dtype (biases
        and norm scales left out), as the layer loop slices them out of its stack (a shard of
        them under fsdp: Llama-2 7B on `data=8` fsdp on `h100:8` replays 1.166 ms of forward
        compute a layer, which whole slices overpriced at 1.366)."""
        return sum(layer_matrices(self.cfg)) * self.e / self.layout.tensor / self.stack_shards
