"""One optimizer step: every layer's cost (`planner.cost.layer_cost`), the resharding between
differing neighbours, the embedding, head and loss, the data-parallel gradient reduction, FSDP's
gathers and the AdamW update, in seconds and bytes per device.

The step-level terms (the gradients' reduction and what hides it, FSDP's clip, the update, the
accumulation passes, one micro-batch's head) are composed once, by `step_terms`, for every step
model: the dense one here, the 3D one (`planner.search.pipeline.price`) and the MoE one
(`planner.cost.moe_step`)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner.cost.fsdp_chain import layer_exposed
from oases_jax.planner.cost.layer_cost import LayerCost, LayerModel
from oases_jax.planner.cost.layer_work import elem_bytes, layer_matrices
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.primepar_cost import head_extra
from oases_jax.planner.layout import Layout, replica_group, tensor_group
from oases_jax.registry import SCHEDULES

# Passes over the logits of a micro-batch (compute dtype), forward and backward, counted in the
# compiled bf16 steps of GPT-2 1.5B and Llama-2 7B on h100:1: the max and the sum of
# exponentials, the label pick, and the hand-written backward's one elementwise pass
# (`models.loss`), with the reductions XLA splits in two.
LOGIT_PASSES = 6
OPTIMIZER_PASSES = 7  # AdamW reads p, g, m, v and writes p, m, v (fp32 each)


@dataclasses.dataclass(frozen=True)
class StepTerms:
    """What a step adds once around its micro-batch loop, whatever runs the layers (seconds per
    device). `exposed_reduce_s` is the part of the gradients' reduction nothing hides: all of
    it after the layer loop (nothing runs beside it there), less only where a layer's own
    backward hides its in-loop reduction (`replica_reduce_s`)."""

    reduce_s: float
    exposed_reduce_s: float
    clip_s: float  # FSDP's global-norm all-reduces, waited for after the backward
    update_s: float  # AdamW and the cast to the compute dtype (`update_s`)
    accumulate_s: float  # the fp32 gradient accumulator's passes, one per micro-batch
    head_s: float  # one micro-batch's embedding, logits and loss, forward and backward
    head_temp_bytes: float

    @property
    def after_loop_s(self) -> float:
        """What follows the micro-batch loop: the reduction nothing hid, clip, update and
        the accumulation passes."""
        return self.exposed_reduce_s + self.clip_s + self.update_s + self.accumulate_s


def local_params(cfg: ModelConfig, layout: Layout, layers: int | None = None) -> float:
    """Parameters one device holds (what its gradient reduction, AdamW and accumulator passes
    move): `layers` blocks (default all; a pipeline stage's own) and the embedding/head, over
    tensor and fsdp. An MoE model's experts split further (`planner.cost.moe_step`).

      local = (layers P_block + P_emb) / (t f)"""
    blocks = cfg.param_count(embeddings=False) / cfg.n_layers
    shared = cfg.param_count() - cfg.param_count(embeddings=False)
    n = cfg.n_layers if layers is None else layers
    return (n * blocks + shared) / (layout.tensor * layout.fsdp)


def step_terms(cfg: ModelConfig, layout: Layout, hw: Hardware, *, local: float,
               reduce_s: float, exposed_reduce_s: float | None = None,
               matrices: float | None = None) -> StepTerms:
    """The step-level terms of a step whose devices hold `local` parameters (`matrices` of
    them weight matrices, as `update_s` defaults) and whose gradients' reduction takes
    `reduce_s` (`exposed_reduce_s` of it waited for; default all):

        clip       = clip_norm_s under fsdp, else 0
        update     = update_s(local, matrices)
        accumulate = M x 12 local B at HBM bandwidth (M > 1; read sum and gradient, write sum)
        head       = head_cost (one micro-batch)"""
    m = layout.microbatches
    head_s, head_temp = head_cost(cfg, layout, hw)
    return StepTerms(
        reduce_s=reduce_s,
        exposed_reduce_s=reduce_s if exposed_reduce_s is None else exposed_reduce_s,
        clip_s=clip_norm_s(cfg, layout, hw) if layout.fsdp > 1 else 0.0,
        update_s=update_s(cfg, local, hw, matrices),
        accumulate_s=hw.mem_s(3 * 4 * local) * m if m > 1 else 0.0,
        head_s=head_s, head_temp_bytes=head_temp)


@dataclasses.dataclass(frozen=True)
class StepCost:
    step_s: float
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    dp_reduce_s: float  # the gradients' reduction, with FSDP's clip
    peak_memory_bytes: float
    memory: dict[str, float]
    terms: StepTerms | None = None


def resharding_s(a: LayerSpec, b: LayerSpec, cfg: ModelConfig, layout: Layout,
                 hw: Hardware) -> float:
    """Moving the residual stream (T D e bytes per replica) between consecutive layers whose
    layouts differ: sequence-sharded -> replicated is an all-gather, the reverse a local slice
    (free); forward and backward (the backward of an all-gather is a reduce-scatter)."""
    if layout.tensor == 1:
        return 0.0
    sa, sb = a.spec.sequence_parallel, b.spec.sequence_parallel
    if sa == sb or not sa:
        return 0.0
    e = elem_bytes(cfg)
    nbytes = layout.rows * layout.seq_len * cfg.d_model * e
    g = tensor_group(layout)
    return hw.comm_s("all-gather", nbytes, g) + hw.comm_s("reduce-scatter", nbytes, g)


def static_memory(cfg: ModelConfig, layout: Layout, local: float | None = None,
                  matrices: float | None = None) -> dict[str, float]:
    """Parameters, gradients and AdamW moments per device (fp32 each) of a device holding
    `local` parameters (default `local_params`: the blocks and the vocabulary over tensor and
    fsdp; an MoE model's experts split further, `planner.cost.moe_step`), `matrices` of them
    weight matrices (default `matrix_share` of them); plus a gradient accumulator with more than
    one micro-batch. Under a narrower compute dtype (e bytes) the weight matrices' gradients are
    written in it (they reach the fp32 parameters through the one cast,
    `models.layers.compute_weights`), and the blocks' weights are cast to it once per step,
    outside the layer loop: one copy lives from the forward to the backward; under fsdp the cast
    copy of the local shard, each layer gathered just before it runs (two in flight):

      grads           = 4 local - (4 - e) matrices
      compute_weights = e (local - P_emb / (t f)) (1 + 2 f / L if f > 1)
    """
    local = local_params(cfg, layout) if local is None else local
    matrices = matrix_share(cfg) * local if matrices is None else matrices
    mem = {"params": 4 * local, "grads": 4 * local, "optimizer": 8 * local}
    e = elem_bytes(cfg)
    if e < 4:
        mem["grads"] -= (4 - e) * matrices
        emb = cfg.param_count() - cfg.param_count(embeddings=False)
        mem["compute_weights"] = e * (local - emb / (layout.tensor * layout.fsdp))
        if layout.fsdp > 1:
            mem["compute_weights"] *= 1 + 2 * layout.fsdp / cfg.n_layers
    if layout.microbatches > 1:
        mem["grad_accumulator"] = 4 * local
    return mem


def gathered_layer_bytes(cfg: ModelConfig, layout: Layout, s: LayerSpec) -> float:
    """Under fsdp, a layer that runs inside its own shard_map (the overlapped schedules:
    `oases`, the rings; `registry` runner not "scan") gathers its weights there, and without
    remat its backward keeps what it gathered: the layer's weight matrices, e bytes a parameter
    over tensor, live from its forward to its backward. (A GSPMD layer, `megatron`, keeps the
    sharded weights and gathers again.) Compiled: oases-h4096-l16, fp32, data=8,tensor=4
    fsdp_tp, 16 x oases/2+none on 3090:32 keeps 16 layers x 201M/4 x 4 B = 3.0 GiB of
    [16, 4096, 4096]-class stacks; the peak was predicted 17.0 GiB against 21.5 without it."""
    if layout.fsdp <= 1 or s.remat != "none" \
            or SCHEDULES[s.schedule].runner(s.sub_batches, layout.tensor) == "scan":
        return 0.0
    return elem_bytes(cfg) * sum(layer_matrices(cfg)) / layout.tensor


def gathered_weights_bytes(cfg: ModelConfig, layout: Layout,
                           strategies: Sequence[LayerSpec]) -> float:
    """`gathered_layer_bytes` over the layers."""
    return sum(gathered_layer_bytes(cfg, layout, s) for s in strategies)


def matrix_share(cfg: ModelConfig) -> float:
    """The share of the parameters that are the layers' weight matrices: cast to the compute
    dtype once per step (`models.layers.compute_weights`), their gradients in that dtype."""
    return cfg.n_layers * sum(layer_matrices(cfg)) / cfg.param_count()


def update_s(cfg: ModelConfig, local_params: float, hw: Hardware,
             matrices: float | None = None) -> float:
    """The once-per-step memory passes over the parameters, at HBM bandwidth: AdamW's
    OPTIMIZER_PASSES fp32 passes (4 B each per parameter); under a narrower compute dtype (e
    bytes), for the weight matrices (`matrices` of the local parameters, default
    `matrix_share` of them): the cast to e bytes (read 4, write e), the gradient read by AdamW
    in e bytes instead of 4, and the global-norm clip's read of it:

        bytes = 28 P + (4 + e - (4 - e) + e) P_mat       (P_mat = 0 when e = 4)
    """
    nbytes = OPTIMIZER_PASSES * 4 * local_params
    e = elem_bytes(cfg)
    if e < 4:
        mats = matrix_share(cfg) * local_params if matrices is None else matrices
        nbytes += (4 + e - (4 - e) + e) * mats
    return hw.mem_s(nbytes)


def head_cost(cfg: ModelConfig, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(seconds, temp bytes) of the embedding, logits and loss for one micro-batch, forward and
    backward: 6 T D V / t FLOPs and `LOGIT_PASSES` passes over T V / t logits; with a
    vocabulary split over t devices plus `head_tensor_comm_s`; under primepar instead the
    gathers and all-reduces of `planner.cost.primepar_cost.head_extra`."""
    e = elem_bytes(cfg)
    tok = layout.rows * layout.seq_len
    v = cfg.padded_vocab / layout.tensor
    flops = 6.0 * tok * cfg.d_model * v
    nbytes = 3 * e * (tok * cfg.d_model + cfg.d_model * v + tok * v)
    t = hw.gemm_s(flops, nbytes, cfg.dtype) \
        + hw.mem_s(LOGIT_PASSES * tok * v * e + 3 * tok * cfg.d_model * e)
    # The logits kept for the backward and their gradient (`models.loss`), e bytes each.
    logits = 2 * tok * v * e
    if layout.primepar:
        extra_s, extra_temp = head_extra(cfg, layout, hw)
        return t + extra_s, logits + extra_temp
    return t + head_tensor_comm_s(cfg, layout, hw), logits


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


def fsdp_collectives(cfg: ModelConfig, layout: Layout, hw: Hardware,
                     reduce: str = "reduce-scatter") -> tuple[float, float, float]:
    """Seconds of a layer's FSDP collectives over the fsdp group: its attention weight gathers
    g_a, its MLP weight gathers g_m, its gradient reduce-scatters r (the embedding's and the
    head's: `embedding_fsdp_s`). The weight matrices move in the compute dtype, the vectors
    (norms, biases) in fp32, half with each sub-layer; one collective per weight matrix (XLA
    combines the layer's vectors into one more), so the per-collective latency counts (GPT-2
    1.5B on h100:8: 7 gathers per layer each way). `reduce`: the collective that reduces a
    layer's gradients."""
    e = elem_bytes(cfg)
    attn, mlp = layer_matrices(cfg)
    rest = cfg.param_count(embeddings=False) / cfg.n_layers - attn - mlp  # norms, biases
    t = layout.tensor
    attn_bytes, mlp_bytes = (attn * e + rest * 4 / 2) / t, (mlp * e + rest * 4 / 2) / t
    group = [i * t for i in range(layout.fsdp)]
    n_attn, n_mlp = 4, (3 if cfg.gated_mlp else 2)

    def coll(kind, nbytes, count):
        return count * hw.comm_s(kind, nbytes / count, group)

    return (coll("all-gather", attn_bytes, n_attn + 1), coll("all-gather", mlp_bytes, n_mlp),
            coll(reduce, attn_bytes + mlp_bytes, n_attn + n_mlp + 1))


def embedding_fsdp_s(cfg: ModelConfig, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(exposed, total) seconds of the embedding's and the head's FSDP collectives, one
    micro-batch, as the partitioner writes them. The head's weight (the table, when tied) is
    gathered once in the compute dtype before the logits, waited for. Untied, the lookup moves
    token rows by all-to-all (tens of KiB) and the head's gradient is reduce-scattered while
    the layers' backward runs (Llama-2 7B, data=8 fsdp on h100:8: one 250 MiB bf16 gather,
    0.52 ms exposed; its reduce-scatter 0.04 ms exposed). Tied, the table's gradient is whole
    only after the lookup's backward, after the layer loop: its f32 reduce-scatter waits, and
    so does an all-gather of the lookup's f32 output gradient over the fsdp group (the
    partitioner replicates it to scatter into the table's D-sharded rows;
    oases-h2048-l24, data=8,tensor=4 fsdp on 3090-nvlink-32: 98 MiB gather 7.1 ms, reduce-scatter
    7.2 ms and the 256 MiB gradient gather 18.9 ms, all exposed).

        untied: exposed = AG(e V D / t),  total = exposed + RS(4 V D / t)
        tied:   exposed = total = AG(e V D / t) + RS(4 V D / t) + AG(4 f rows L D)"""
    group = [i * layout.tensor for i in range(layout.fsdp)]
    table = cfg.padded_vocab * cfg.d_model / layout.tensor
    gather = hw.comm_s("all-gather", elem_bytes(cfg) * table, group)
    reduce = hw.comm_s("reduce-scatter", 4 * table, group)
    if not cfg.tied:
        return gather, gather + reduce
    dx = 4 * layout.fsdp * layout.rows * layout.seq_len * cfg.d_model
    waited = gather + reduce + hw.comm_s("all-gather", dx, group)
    return waited, waited


def clip_norm_s(cfg: ModelConfig, layout: Layout, hw: Hardware) -> float:
    """The gradient clip's global norm under fsdp: each parameter array sharded over the
    replicas (every one with a D axis: the rules shard "embed" over `data`) sums its squares
    locally and all-reduces the scalar over all devices, one latency-bound all-reduce each,
    after the backward (oases-h2048-l24 on 3090-nvlink-32, data=8,tensor=4 fsdp: 16 all-reduces
    of 4 bytes over the 32 devices, 0.93 ms each, 13.5 ms exposed in all)."""
    bias = cfg.use_bias
    norms = 2 if bias else 1  # arrays per norm: scale (and bias)
    block = 2 * norms + 4 + (3 if cfg.gated_mlp else 2) + (2 if bias else 0)  # + out, down bias
    arrays = block + 1 + norms + (1 if cfg.learned_positions else 0) + (0 if cfg.tied else 1)
    return arrays * hw.comm_s("all-reduce", 4, list(range(layout.n_devices)))


def fsdp_comm_s(cfg: ModelConfig, layout: Layout, hw: Hardware,
                strategies: Sequence[LayerSpec]) -> tuple[float, float]:
    """(exposed, total) seconds of FSDP's collectives for one micro-batch. The layer loop gathers
    each layer's weights over the fsdp group before its forward and again before its backward
    (a recompute uses the backward's gather) and reduce-scatters its gradients after it; the
    weight matrices move in the compute dtype (cast before the gather,
    `models.layers.compute_weights`), their gradients too, the rest (norms, biases) in fp32.
    What each layer waits for is replayed as XLA's scheduler orders its collectives
    (`planner.cost.fsdp_chain`): one gather in flight, none for the next layer, the weight
    gradients last, each followed by its reduce-scatter. The embedding and head outside the
    loops: `embedding_fsdp_s`.

        exposed = sum over layers (fwd_l + bwd_l) + embedding's exposed"""
    emb_exposed, emb_total = embedding_fsdp_s(cfg, layout, hw)
    per = {s: layer_exposed(cfg, layout, hw, s) for s in set(strategies)}
    layers = sum(per[s][2] for s in strategies)
    total = layers + emb_total
    if not hw.async_collectives:  # CPU: every collective is synchronous
        return total, total
    exposed = sum(per[s][0] + per[s][1] for s in strategies) + emb_exposed
    return exposed, total


# The share of a layer's backward that hides its gradients' all-reduce over the replicas inside
# the backward loop: GPT-2 1.5B data=8 on h100:8, one iteration replayed alone, 0.407 ms of
# all-reduce and 0.497 of compute take 0.763 ms (0.266 exposed).
REPLICA_REDUCE_HIDDEN = 0.28


def replica_reduce_s(cfg: ModelConfig, layout: Layout, hw: Hardware,
                     strategies: Sequence[LayerSpec], layer_costs: dict[LayerSpec, LayerCost],
                     local_params: float) -> tuple[float, float]:
    """(exposed, total) seconds of the gradients' all-reduce over the replicas (fsdp == 1).

    Accumulated over micro-batches (per data group, `training.state._accumulate_in_groups`), the
    fp32 sums are all-reduced once after the loop, synchronously: nothing hides them. Without
    micro-batches the partitioner reduces each layer's weight gradients inside the backward
    loop, in the compute dtype, as soon as they are made (GPT-2 1.5B, `data=2,tensor=4` on
    `h100:8`: one 14.65 MiB bf16 all-reduce a layer), where they hide behind what is left of
    the layer's own backward (nothing crosses an iteration), and with a tensor axis behind
    nothing (the tensor collectives after it on the one stream wait); the embedding's, the
    vectors' (fp32) and the last layer's are issued after the loop, when nothing is left to
    hide them, a tied table's gradient as two all-reduces, one per use (its lookup's and the
    head's, each V D / t fp32; oases-h4096-l16 on 3090-nvlink-32, data=8,tensor=4: two
    196.5 MiB all-reduces, 29 ms each, after the backward loop):

        exposed = (L - 1) max(0, r - h B) + r + r_rest
        h = REPLICA_REDUCE_HIDDEN without a tensor axis, else 0"""
    rgroup = replica_group(layout)
    whole = hw.comm_s("all-reduce", 4 * local_params, rgroup)
    if layout.microbatches > 1 or not hw.async_collectives or len(rgroup) <= 1:
        return whole, whole
    n = len(strategies)
    matrices = sum(layer_matrices(cfg)) / layout.tensor
    per_layer = hw.comm_s("all-reduce", elem_bytes(cfg) * matrices, rgroup)
    tied = cfg.padded_vocab * cfg.d_model / layout.tensor if cfg.tied else 0.0
    rest = hw.comm_s("all-reduce", 4 * (max(local_params - n * matrices, 0.0) + tied), rgroup)
    # Issued after the layer's last weight gradient and done within its iteration: only the
    # compute left in it hides the reduction (REPLICA_REDUCE_HIDDEN of the layer's backward),
    # and with a tensor axis not even that: it holds up the tensor collectives behind it.
    hidden = 0.0 if layout.tensor > 1 else REPLICA_REDUCE_HIDDEN
    in_loop = sum(max(0.0, per_layer - hidden * layer_costs[s].bwd_s) for s in strategies[1:])
    return in_loop + per_layer + rest, n * per_layer + rest


def score_relayout_bytes(strategies: Sequence[LayerSpec],
                         layer_costs: dict[LayerSpec, LayerCost]) -> float:
    """The largest stack of saved f32 scores XLA copies whole between the layer loops: the
    forward loop writes each run of alike layers' scores into a stack in one layout, and the
    backward loop reads them in another, so XLA transposes the stacks one at a time (one per
    sub-batch and saved copy), each into a fresh buffer, before the backward starts; no layer's
    backward temporaries are live then. oases-h2048-l24, fp32, on 3090-nvlink-32 (the benchmark
    set): primepar's two [24, 2, 16, 1024, 1024] f32 stacks, 3 GiB each, and 24 x oases/4's
    eight 768 MiB stacks, each transposed (`input_transpose_fusion`) into a third buffer; the
    planner's peaks were 10.2% and 6.8% low without it.

        relayout = max over runs of alike layers (run length x score_copy_bytes)"""
    runs = itertools.groupby(strategies)
    return max((len(list(run)) * layer_costs[s].score_copy_bytes for s, run in runs),
               default=0.0)


def step_cost(cfg: ModelConfig, layout: Layout, strategies: Sequence[LayerSpec], hw: Hardware,
              layer_costs: dict[LayerSpec, LayerCost] | None = None) -> StepCost:
    """One optimizer step: `microbatches` x (head + every layer's forward and backward, plus
    resharding between differing neighbours), then the data-parallel gradient reduction and
    the AdamW update.

    Gradient reduction: over the replicas `replica_reduce_s`; under fsdp the layers'
    reduce-scatters run inside the loop (`fsdp_comm_s`) and what remains is an all-reduce over
    `data` after it, waited for. Optimizer: `update_s`.
    """
    if layer_costs is None:
        lm = LayerModel(cfg, layout, hw)
        layer_costs = {s: lm.time(s) for s in set(strategies)}
    m = layout.microbatches
    layers = sum(layer_costs[s].step_s for s in strategies)
    pairs = zip(strategies, strategies[1:], strict=False)
    reshard = sum(resharding_s(a, b, cfg, layout, hw) for a, b in pairs)
    static = static_memory(cfg, layout)
    local = static["params"] / 4
    if layout.fsdp > 1:
        # Each layer's weights gathered for its forward and again for its backward, its
        # gradients reduce-scattered, inside the layer loop beside the layers' compute
        # (`fsdp_comm_s`); then an all-reduce over the data axis of the sharded gradients.
        exposed_micro, fsdp_comm = fsdp_comm_s(cfg, layout, hw, strategies)
        dgroup = [i * layout.tensor * layout.fsdp for i in range(layout.data)]
        terms = step_terms(cfg, layout, hw, local=local,
                           reduce_s=hw.comm_s("all-reduce", 4 * local, dgroup))
        fsdp_s = m * exposed_micro
    else:
        exposed, reduce = replica_reduce_s(cfg, layout, hw, strategies, layer_costs, local)
        terms = step_terms(cfg, layout, hw, local=local, reduce_s=reduce,
                           exposed_reduce_s=exposed)
        fsdp_s = fsdp_comm = 0.0
    head_s, head_temp = terms.head_s, terms.head_temp_bytes
    after = terms.update_s + terms.accumulate_s
    step = m * (layers + reshard + head_s) + fsdp_s + terms.after_loop_s
    compute = m * (sum(layer_costs[s].compute_s for s in strategies) + head_s) + after
    reduce = terms.reduce_s + terms.clip_s
    comm = m * (sum(layer_costs[s].comm_s for s in strategies) + reshard + fsdp_comm) + reduce
    acts = sum(layer_costs[s].act_bytes for s in strategies)
    temp = max(max(layer_costs[s].temp_bytes for s in strategies), head_temp,
               score_relayout_bytes(strategies, layer_costs))
    memory = {**static, "activations": acts, "temporaries": temp}
    kept = gathered_weights_bytes(cfg, layout, strategies)
    if kept:
        memory["gathered_weights"] = kept
    return StepCost(step_s=step, compute_s=compute, comm_s=comm,
                    exposed_comm_s=max(step - compute, 0.0), dp_reduce_s=reduce,
                    peak_memory_bytes=sum(memory.values()), memory=memory, terms=terms)
