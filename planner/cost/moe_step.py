"""One optimizer step of an MoE model on a data x expert x tensor layout: the dense layers and
the MoE layers' attention priced as the dense planner prices them (`planner.cost.layer_cost`), each
MoE feed-forward by the MoE cost model (`oases_jax.moe.cost`) priced by the planner's one
`Hardware` (datasheet, calibration profile or XLA's fits) on the links its expert and tensor
groups cross, the experts' parameters and
optimizer state split over expert x tensor, and the dispatch buffers in memory."""

from __future__ import annotations

import dataclasses

from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.moe import cost as cost
from oases_jax.moe import schedules as moe_schedules
from oases_jax.planner.cost.layer_cost import LayerCost, LayerModel
from oases_jax.planner.cost.layer_work import (
    SubLayerWork,
    elem_bytes,
    layer_matrices,
    sequence_split,
)
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import StepCost, local_params, static_memory, step_terms
from oases_jax.planner.layout import Layout, data_group, expert_group, replica_group, tensor_group

# What an expert axis may run: the Parm schedules; without one, `local` (S1 with N_EP = 1).
EP_SCHEDULES = ("ds_moe", "parm_s1", "parm_s2")
LOCAL = "local"


@dataclasses.dataclass(frozen=True, order=True)
class MoEChoice:
    """How a plan's MoE layers run: an MoE schedule and its chunk count (1 unless parm_s2)."""

    schedule: str
    chunks: int = 1

    def label(self) -> str:
        chunked = moe_schedules.get(self.schedule).chunked
        return f"{self.schedule}/{self.chunks}" if chunked else self.schedule


def moe_shape(cfg: ModelConfig, layout: Layout) -> cost.LayerShape:
    """One MoE layer on `layout`, as the runtime resolves it: T = rows x seq tokens per
    (data, expert) shard, i.e. per tensor group (`oases_jax.moe.layer.moe_layer`)."""
    return cost.LayerShape(
        tokens=layout.rows * layout.seq_len, d_model=cfg.d_model, d_ff=cfg.expert_ff_dim,
        experts=cfg.n_experts, top_k=cfg.top_k, capacity_factor=cfg.capacity_factor,
        dtype_bytes=elem_bytes(cfg), gated=cfg.gated_mlp, ep=layout.expert, mp=layout.tensor,
        dp=layout.data)


def moe_hardware(layout: Layout, hw: Hardware) -> cost.MoEHardware:
    """The MoE model's hardware: the planner's prices (`hw`, its profile included) and the links
    of one expert group and one tensor group of this layout (expert inside or across nodes, as
    the layout orders it)."""
    return cost.MoEHardware.of(hw.cluster, expert_group(layout), tensor_group(layout), prices=hw)


def moe_choices(cfg: ModelConfig, layout: Layout, schedules=EP_SCHEDULES) -> list[MoEChoice]:
    """The MoE schedules a layout can run: `local` without an expert axis; else those of
    `schedules` among ds_moe, parm_s1 and parm_s2 with each chunk count of the cost model
    (`moe_cost.CHUNKS`) up to the slots per expert."""
    if layout.expert == 1:
        return [MoEChoice(LOCAL)]
    shape = moe_shape(cfg, layout)
    out = [MoEChoice("parm_s1")] if "parm_s1" in schedules else []
    if "parm_s2" in schedules:
        out += [MoEChoice("parm_s2", r) for r in cost.CHUNKS
                if r > 1 and r <= cost.slots(shape, "parm_s1")]
    # Last: without a tensor split ds_moe prices the same as parm_s1; ties go to Parm's.
    return out + ([MoEChoice("ds_moe")] if "ds_moe" in schedules else [])


@dataclasses.dataclass(frozen=True)
class MoEFFNCost:
    """One MoE feed-forward, one micro-batch on one device: forward, backward (with the
    forward's recomputation under remat), the part of them no communication adds (`compute_s`),
    saved activations and backward working set."""

    fwd_s: float
    bwd_s: float
    compute_s: float
    act_bytes: float
    temp_bytes: float

    @property
    def step_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def comm_s(self) -> float:
        """What the MoE collectives add beyond the compute (exposed communication)."""
        return max(self.step_s - self.compute_s, 0.0)


def moe_ffn_cost(cfg: ModelConfig, layout: Layout, hw: Hardware, choice: MoEChoice,
                 dense: LayerSpec) -> MoEFFNCost:
    """`moe_cost.estimate` of the choice on the layout's links, adjusted for the residual
    stream the dense schedule leaves (r = the all-gather of T D e bytes over tensor, the
    restore the estimate counts once forward and once backward):
      parm_s1/s2/local under a sequence-parallel dense schedule: the stream is already split
        over tensor, so no restore: - 2 r
      ds_moe under a sequence-parallel schedule: its input is gathered first: + 2 r
    Remat (save_proj or full: nothing in the MoE feed-forward is saved by name) recomputes the
    forward before the backward. Compute alone: the same estimate with collectives of no cost."""
    shape, mhw = moe_shape(cfg, layout), moe_hardware(layout, hw)
    name = "parm_s1" if choice.schedule == LOCAL else choice.schedule
    est = cost.estimate(shape, mhw, name, choice.chunks)
    free = cost.estimate(shape, dataclasses.replace(mhw, comm=False), name, choice.chunks)
    restore = hw.comm_s("all-gather", shape.tokens * shape.d_model * shape.dtype_bytes,
                        tensor_group(layout))
    seq = sequence_split(dense.schedule, layout.tensor) > 1
    adjust = 0.0 if not seq else -restore if moe_schedules.get(name).dedup else restore
    fwd = est.forward_s + adjust
    bwd = est.backward_s + adjust + (fwd if dense.remat != "none" else 0.0)
    compute = free.forward_s + free.backward_s \
        + (free.forward_s if dense.remat != "none" else 0.0)
    saved, work = moe_buffers(cfg, layout, name, choice.chunks)
    act = saved if dense.remat == "none" else 0.0
    temp = work + (saved if dense.remat != "none" else 0.0)
    return MoEFFNCost(fwd_s=fwd, bwd_s=bwd, compute_s=compute, act_bytes=act, temp_bytes=temp)


def moe_buffers(cfg: ModelConfig, layout: Layout, schedule: str, chunks: int
                ) -> tuple[float, float]:
    """(saved bytes, backward working set) of one MoE feed-forward per device and micro-batch.
    With T_g the tokens a device gates (T/t, all T for ds_moe), N = E x slots the rows of its
    dispatch buffer (`moe_cost.slots`: capacity, per chunk padding included), e bytes:
      saved  = T_g D e (gate input) + 3 x 4 T_g E (f32 logits, probabilities, mask)
             + b N D e (dispatch, after the all-to-all, after the ESP all-gather (t N rows),
               after the reduce-scatter, after the all-to-all back: b = 2 + 2 [ep>1] + t [t>1])
             + g N F e (each expert's hidden on the t N gathered rows, F/t wide: g = 3 gated,
               2 otherwise)
      work   = (t N D + g N F) e (the gradients of the gathered buffer and of the hidden)"""
    shape = moe_shape(cfg, layout)
    e, t, d, f = elem_bytes(cfg), layout.tensor, cfg.d_model, cfg.expert_ff_dim
    n = cfg.n_experts * cost.slots(shape, schedule, chunks)
    gated = 3 if cfg.gated_mlp else 2
    gate_tokens = shape.tokens / t if moe_schedules.get(schedule).dedup else shape.tokens
    bufs = 2 + (2 if layout.expert > 1 else 0) + (t if t > 1 else 0)
    saved = gate_tokens * d * e + 3 * 4 * gate_tokens * cfg.n_experts \
        + bufs * n * d * e + gated * n * f * e
    return saved, (t * n * d + gated * n * f) * e


class AttentionModel(LayerModel):
    """An MoE layer without its feed-forward: the dense layer model with the MLP's GEMMs,
    activation and collectives taken out (its norm kept), for the attention half."""

    def sublayers(self, rows, strategy, chunks=1):
        work = super().sublayers(rows, strategy, chunks)
        mlp = work["mlp"]
        return {**work, "mlp": SubLayerWork(pre=mlp.pre, col=0.0, core=0.0, row=0.0,
                                            col_bytes=0.0)}

    def saved_bytes(self, strategy: LayerSpec) -> float:
        """The dense formula (`LayerModel.saved_bytes`) without the MLP: no hidden (none), and
        under save_proj the attention's two saved projections only."""
        c, t, e = self.cfg, self.layout.tensor, self.e
        tok = self.layout.rows * self.layout.seq_len
        s = sequence_split(strategy.schedule, t)
        if strategy.remat == "none":
            hidden = (3 if c.gated_mlp else 2) * tok * c.ff_dim / t
            return super().saved_bytes(strategy) - hidden * e
        if strategy.remat == "save_proj":
            spec = strategy.spec
            gathers = t > 1 and (spec.rings or spec.projection == "seq_parallel")
            qkv = tok * (c.n_heads + 2 * c.kv_heads) * c.k_dim / t
            return (3 * tok * c.d_model / s + (qkv if gathers else 0.0)) * e
        return super().saved_bytes(strategy)


def moe_static_memory(cfg: ModelConfig, layout: Layout) -> dict[str, float]:
    """`step_cost.static_memory` of a device holding an MoE model's share (`moe_params`)."""
    return static_memory(cfg, layout, *moe_params(cfg, layout))


def moe_params(cfg: ModelConfig, layout: Layout) -> tuple[float, float]:
    """(local, matrices): the parameters one device holds, the experts' split over expert x
    tensor and everything else as a dense model holds it (`_local_params`), and of them those
    `models.layers.compute_weights` casts to the compute dtype: every layer's attention
    matrices and the dense layers' MLP matrices over tensor x fsdp, and all the experts' weights
    (their stacked biases are matrices too):
      local    = (P - P_exp) / (t f) + P_mat / (ep t) + P_bout / ep
      matrices = (L A + (L - L_moe) M) / (t f) + P_mat / (ep t) + P_bout / ep"""
    dense, experts = _local_params(cfg, layout)
    attn, mlp = layer_matrices(cfg)
    n_dense = cfg.n_layers - cfg.n_moe_layers
    mats = (cfg.n_layers * attn + n_dense * mlp) / (layout.tensor * layout.fsdp)
    return dense + experts, mats + experts


def _local_params(cfg: ModelConfig, layout: Layout) -> tuple[float, float]:
    """(dense, expert) parameters on one device: everything but the experts as a dense model
    holds it (`step_cost.local_params`), the experts' matrices and input biases over expert x
    tensor, their output biases over expert."""
    d, f, n = cfg.d_model, cfg.expert_ff_dim, (cfg.n_experts or 0) * cfg.n_moe_layers
    mats = n * (d * f * (3 if cfg.gated_mlp else 2) + (f if cfg.use_bias else 0))
    b_out = n * d if cfg.use_bias else 0
    t, ep = layout.tensor, layout.expert
    dense = local_params(cfg, layout) - (mats + b_out) / (t * layout.fsdp)
    return dense, mats / (ep * t) + b_out / ep


def grad_reduce_s(cfg: ModelConfig, layout: Layout, hw: Hardware) -> float:
    """The gradient reduction of one step: the dense gradients (4 bytes each) all-reduced over
    data x expert, the experts' over data alone. With an expert axis the runtime's batch is
    split over more than `data`, so accumulation reduces every micro-batch
    (`training.state.accumulation_groups`): x microbatches."""
    dense, experts = _local_params(cfg, layout)
    reduce = hw.comm_s("all-reduce", 4 * dense, replica_group(layout)) \
        + hw.comm_s("all-reduce", 4 * experts, data_group(layout))
    return reduce * (layout.microbatches if layout.expert > 1 else 1)


@dataclasses.dataclass(frozen=True)
class MoEStep:
    """A priced MoE plan: the step (as the dense planner's `StepCost`) and what explains it:
    every MoE feed-forward of the step (`moe_s`), their exposed communication (`moe_comm_s`)
    and the gradient reduction (`reduce_s`)."""

    cost: StepCost
    moe_s: float
    moe_comm_s: float
    reduce_s: float


def moe_step_cost(cfg: ModelConfig, layout: Layout, dense: LayerSpec, choice: MoEChoice,
                  hw: Hardware, costs: tuple[LayerCost | None, LayerCost] | None = None
                  ) -> MoEStep:
    """One step: microbatches x (head + (L - L_moe) dense layers + L_moe x (attention +
    MoE feed-forward)), then the step-level terms every step model adds (`step_terms`: the
    gradient reduction, `grad_reduce_s`, after the layer loop where nothing hides it; the
    update; the accumulation passes); memory as `moe_static_memory` plus
    every layer's saved activations and the largest working set. `costs`: the dense layer's
    and the attention half's `LayerCost` under `dense` when already priced (`layer_costs`)."""
    m, n_moe = layout.microbatches, cfg.n_moe_layers
    n_dense = cfg.n_layers - n_moe
    lc, attn = costs or layer_costs(cfg, layout, dense, hw)
    # A model without MoE layers prices as the dense step does (its step-level terms too).
    ffn = moe_ffn_cost(cfg, layout, hw, choice, dense) if n_moe else MoEFFNCost(
        fwd_s=0.0, bwd_s=0.0, compute_s=0.0, act_bytes=0.0, temp_bytes=0.0)
    layers = n_moe * (attn.step_s + ffn.step_s) + (n_dense * lc.step_s if lc else 0.0)
    compute = n_moe * (attn.compute_s + ffn.compute_s) + (n_dense * lc.compute_s if lc else 0.0)
    comm = n_moe * (attn.comm_s + ffn.comm_s) + (n_dense * lc.comm_s if lc else 0.0)
    local, matrices = moe_params(cfg, layout)
    static = static_memory(cfg, layout, local, matrices)
    terms = step_terms(cfg, layout, hw, local=local, matrices=matrices,
                       reduce_s=grad_reduce_s(cfg, layout, hw))
    head_s, head_temp, reduce = terms.head_s, terms.head_temp_bytes, terms.reduce_s
    step = m * (layers + head_s) + terms.after_loop_s
    compute_all = m * (compute + head_s) + terms.update_s + terms.accumulate_s
    acts = n_moe * (attn.act_bytes + ffn.act_bytes) + (n_dense * lc.act_bytes if lc else 0.0)
    temps = ([attn.temp_bytes + ffn.temp_bytes] if n_moe else []) + [head_temp] \
        + ([lc.temp_bytes] if lc else [])
    memory = {**static, "activations": acts, "temporaries": max(temps)}
    sc = StepCost(step_s=step, compute_s=compute_all, comm_s=m * comm + reduce,
                  exposed_comm_s=max(step - compute_all, 0.0), dp_reduce_s=reduce,
                  peak_memory_bytes=sum(memory.values()), memory=memory, terms=terms)
    return MoEStep(cost=sc, moe_s=m * n_moe * ffn.step_s, moe_comm_s=m * n_moe * ffn.comm_s,
                   reduce_s=reduce)


def layer_costs(cfg: ModelConfig, layout: Layout, dense: LayerSpec, hw: Hardware
                ) -> tuple[LayerCost | None, LayerCost]:
    """(a dense layer, an MoE layer's attention half) under `dense` (for `--explain`)."""
    n_dense = cfg.n_layers - cfg.n_moe_layers
    return (LayerModel(cfg, layout, hw).time(dense) if n_dense else None,
            AttentionModel(cfg, layout, hw).time(dense))

