"""Attention in a compiled program: cuDNN's fused (flash) attention custom calls priced from their
shapes, since neither XLA nor a count of dots sees their FLOPs, and which kind of attention a
program holds (`attention_kernel`)."""

from __future__ import annotations

import math
import re

from oases_jax.tools.analysis.hlo import Computation, HloModule, Instr

# cuDNN's fused multi-head attention targets: `__cudnn$fmhaSoftmax`, `__cudnn$fmhaSoftmaxBackward`
# and their dropout / bias / FP8 variants.
FUSED_ATTENTION_PREFIX = "__cudnn$fmha"
KERNELS = ("cudnn_flash", "materialised", "none")


def custom_call_target(instr: Instr) -> str:
    return (instr.attr("custom_call_target") or "").strip('"')


def is_fused_attention(instr: Instr) -> bool:
    return instr.opcode == "custom-call" and custom_call_target(instr).startswith(
        FUSED_ATTENTION_PREFIX)


def is_backward(instr: Instr) -> bool:
    return "Backward" in custom_call_target(instr)


def _dims(comp: Computation, operand: str) -> tuple[int, ...]:
    instr = comp.by_name.get(operand)
    return instr.shapes[0].dims if instr is not None and instr.shapes else ()


def attention_shape(instr: Instr, comp: Computation) -> tuple[int, int, int, int, int]:
    """(B·H, Lq, Lk, K, Kv) of a fused-attention call: batch times query heads, query and key
    lengths, the head dims of Q/K and of V. B·H·Lq·Lk is the scores' shape cuDNN records in
    `intermediate_tensor_shape`; K and Kv are the last dims of the Q and V operands (the head dim
    in both of jax's layouts, BTNH and BNTH). Without the recorded shape, BTNH is read from Q
    [B, Lq, H, K] and K [B, Lk, G, K] (BNTH when the first GEMM's batch dims are 0 and 1)."""
    q, k, v = (_dims(comp, o) for o in (instr.operands[:3] + ["", "", ""])[:3])
    config = instr.backend_config.get("cudnn_fmha_backend_config", {})
    scores = [int(d) for d in config.get("intermediate_tensor_shape", {}).get("dimensions", [])]
    if len(scores) == 4:
        bh, lq, lk = scores[0] * scores[1], scores[2], scores[3]
    elif len(q) == 4 and len(k) == 4:
        batch = config.get("bmm1_dot_dimension_numbers", {}).get("lhs_batch_dimensions", [])
        seq = 2 if [int(d) for d in batch] == [0, 1] else 1  # BNTH, else BTNH
        bh, lq, lk = q[0] * q[3 - seq], q[seq], k[seq]
    else:
        return (0, 0, 0, 0, 0)
    head = q[-1] if q else 0
    return bh, lq, lk, head, v[-1] if v else head


def fused_attention_flops(instr: Instr, comp: Computation) -> float:
    """FLOPs of one fused-attention call, counting its GEMMs (2 x multiply-adds) as a dot would.

    With N = B·H·Lq·Lk score entries (`attention_shape`), K the Q/K head dim and Kv V's:

        forward   S = Q K^T (2·N·K), O = P V (2·N·Kv)                  2·N·(K + Kv)
        backward  S = Q K^T again (2·N·K), dV = P^T dO (2·N·Kv),
                  dP = dO V^T (2·N·Kv), dQ = dS K (2·N·K), dK = dS^T Q (2·N·K)
                                                                        2·N·(3K + 2Kv)

    so with K = Kv the forward is 4·B·H·L²·K and the backward 10·B·H·L²·K, 2.5 times the forward.
    A causal mask (`mask_type` CAUSAL or PADDING_CAUSAL) halves both: the kernel skips the score
    tiles above the diagonal (L(L+1)/2 of L² entries, taken as L²/2). Softmax and scaling
    (O(N) element-wise work) are left out, as for materialised attention's dots."""
    bh, lq, lk, k, kv = attention_shape(instr, comp)
    n = bh * lq * lk
    flops = 2.0 * n * ((3 * k + 2 * kv) if is_backward(instr) else (k + kv))
    mask = instr.backend_config.get("cudnn_fmha_backend_config", {}).get("mask_type", "")
    return flops / 2 if "CAUSAL" in str(mask) else flops


def _dot_sizes(instr: Instr, comp: Computation) -> tuple[int, int, int, int] | None:
    """(batch, contracted, lhs free, rhs free) sizes of a dot or a GEMM custom call, or None."""
    keys = ("lhs_batch", "lhs_contracting", "rhs_batch", "rhs_contracting")
    if instr.opcode == "dot":
        nums = {k: [int(d) for d in re.findall(r"\d+", instr.attr(f"{k}_dims") or "")]
                for k in keys}
    elif instr.opcode == "custom-call" and "gemm_backend_config" in instr.backend_config:
        dnums = instr.backend_config["gemm_backend_config"].get("dot_dimension_numbers", {})
        nums = {k: [int(d) for d in dnums.get(f"{k}_dimensions", [])] for k in keys}
    else:
        return None
    if len(instr.operands) < 2:
        return None
    lhs, rhs = _dims(comp, instr.operands[0]), _dims(comp, instr.operands[1])

    def size(dims, picked):
        return math.prod(dims[i] for i in picked if i < len(dims))

    def free(dims, side):
        used = set(nums[f"{side}_batch"]) | set(nums[f"{side}_contracting"])
        return size(dims, [i for i in range(len(dims)) if i not in used])

    return (size(lhs, nums["lhs_batch"]), size(lhs, nums["lhs_contracting"]), free(lhs, "lhs"),
            free(rhs, "rhs"))


def is_score_gemm(instr: Instr, comp: Computation) -> bool:
    """A GEMM shaped like materialised attention's scores S = Q K^T (or their gradient
    dP = dO V^T): batched (over batch and KV heads), contracting the head dim, with a free side
    of L keys and one of L queries (times the query heads sharing a KV head, as XLA may merge
    them): both free sides longer than the contraction, one a multiple of the other. Only
    attention makes batched GEMMs in this project's programs (projections and the MLP have no
    batch dimensions); attention over L <= head_dim is not recognised."""
    sizes = _dot_sizes(instr, comp)
    if sizes is None:
        return False
    batch, contracted, lhs, rhs = sizes
    small, large = sorted((lhs, rhs))
    return batch > 1 and contracted < small and large % small == 0


def attention_kernel(module: HloModule) -> str:
    """Which attention a compiled program holds: "cudnn_flash" (cuDNN's fused-attention custom
    calls, no scores in memory), "materialised" (score GEMMs, `is_score_gemm`, in any
    computation, fusions included) or "none"."""
    found = "none"
    for comp in module.computations.values():
        for instr in comp.instrs:
            if is_fused_attention(instr):
                return "cudnn_flash"
            if found == "none" and is_score_gemm(instr, comp):
                found = "materialised"
    return found
