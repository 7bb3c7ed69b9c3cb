"""FSDP inside a pipeline's stages (`--rules fsdp`, and `fsdp_tp` where tensor > 1): what a
layer's weight gathers and gradient reduction add to its forward and backward in the tick
executor's branches, for the 3D search (`planner.search.pipeline`; docs/planner.md, "3D
search")."""

from __future__ import annotations

from oases_jax.models.config import ModelConfig
from oases_jax.planner.cost.layer_work import elem_bytes, layer_matrices
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.step_cost import fsdp_collectives
from oases_jax.planner.layout import Layout

# The layer strategies offered under fsdp_tp inside the stages: GSPMD's. Compiled for h100:16
# (GPT-2 1.5B with 20 heads, bf16, xla attention, stage=2 x fsdp=4 x tensor=2, GPipe M=4), megatron
# ran 205.3 ms against 180.9 predicted, but oases 381.9 against 181.2 at 41.3 GiB (25.6 for
# megatron): its shard_map layers keep what they gather for the backward, in every slot of the
# residual pools (docs/planner.md, "3D search").
FSDP_TP_STAGE_SCHEDULES = ("megatron", "megatron_sp")
# FSDP inside the stages: the shares of a layer's forward and backward work (the flattened
# pools' passes included) that its weight gathers (forward) and gradient all-reduce (backward)
# hide behind (`fsdp_layer_s`).
FSDP_FWD_HIDDEN = 0.31
FSDP_BWD_HIDDEN = 0.28


def fsdp_layer_s(cfg: ModelConfig, layout: Layout, hw: Hardware, fwd_s: float,
                 bwd_s: float) -> tuple[float, float, float]:
    """FSDP inside a stage (`--rules fsdp`): what one layer's collectives add to its forward
    (`fwd_s` of work, F) and backward (`bwd_s`, B) for one micro-batch, and the bytes of its
    gathered weights. A branch of the tick loop gathers its layers' weights over the replicas
    in the compute dtype and keeps them for the branch (the stage's stacked bf16[24, 1600,
    6400] in the program below: a layer's whole matrices, per layer of the stage, in the
    stage's memory). The forward's gathers hide behind part of the forward; in the backward
    the gathers hide and the gradients' reduction (an all-reduce of the whole matrices inside
    the tick's branches, then a slice: the partitioner emits no reduce-scatter there) behind
    part of the backward:

        forward  = max(0, g_a + g_m - FSDP_FWD_HIDDEN F)
        backward = max(0, r - FSDP_BWD_HIDDEN B)

    F and B count the flattened pools' passes (interleaved), whose transposes the gathers
    hide behind too. The two shares are least-squares fits to four compiled programs (GPT-2
    1.5B, bf16, h100:16), each against the same plan without FSDP, per layer and micro-batch
    (docs/planner.md, "FSDP inside the stages"):

        program                                  measured F / B     the rule
        stage=2,data=8, GPipe M=4 (1 row)        +0.121 / +0.342    0.157 / 0.371
        stage=4,data=4, GPipe M=8 (1 row)        +0.106 / +0.159    0.056 / 0.169
        stage=4,data=4, interleaved M=8 (1 row)  +0.014 / +0.131    0.026 / 0.158
        stage=2,data=8, interleaved M=2 (2 rows) +0.003 / +0.242    0.000 / 0.208

    Under fsdp_tp (tensor > 1) the gathers and the all-reduce share the collective stream with
    the layers' tensor all-reduces and none of them hides: with the shares above, stage=2 x
    fsdp=4 x tensor=2, interleaved M=2 and M=4 (GPT-2 1.5B with 20 heads) were predicted 173.7 and
    179.4 ms against 192.7 and 201.3 compiled; with nothing hidden, 189.1 and 207.0. On CPU
    devices collectives are synchronous (`Hardware.async_collectives`): the forward pays its
    gathers and the backward its gathers and the all-reduce, whole."""
    ag_a, ag_m, ar = fsdp_collectives(cfg, layout, hw, reduce="all-reduce")
    attn, mlp = layer_matrices(cfg)
    gathered = elem_bytes(cfg) * (attn + mlp) / layout.tensor
    if not hw.async_collectives:  # CPU: nothing hides; the backward's branch gathers again
        return ag_a + ag_m, ag_a + ag_m + ar, gathered
    if layout.tensor > 1:  # fsdp_tp: in series with the tensor all-reduces, nothing hides
        return ag_a + ag_m, ar, gathered
    fwd = max(0.0, ag_a + ag_m - FSDP_FWD_HIDDEN * fwd_s)
    bwd = max(0.0, ar - FSDP_BWD_HIDDEN * bwd_s)
    return fwd, bwd, gathered
