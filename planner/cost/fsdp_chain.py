"""FSDP's weight gathers and gradient reduce-scatters inside one layer's loop iteration, as XLA's
GPU scheduler orders them, priced by the two-stream replay (`oases_jax.streams`).

Read off the compiled layer loops (`benchmarks/fsdp_layer_replay.py`: GPT-2 1.5B and Llama-2 7B,
`data=8` and `data=4,tensor=2` under fsdp on `h100:8`, one iteration of each loop replayed alone):

- the gathers of one iteration run one after another on the one collective stream, one in
  flight, and nothing is gathered for the next iteration (no cross-iteration prefetch), so the
  first weight matrix an iteration uses is waited for whole and each later gather hides behind
  the GEMM of the matrix before it;
- forward: the matrices are gathered in the order they are used, but the last (the MLP's down
  projection) only after the MLP's column GEMMs, so it is waited for whole too;
- backward: the matrices are gathered in the order the backward uses them (the MLP's first,
  then attention's; under remat in the recomputation's order), the first waited for at once;
  the input gradients run first and the weight gradients last, each followed by its
  reduce-scatter, one in flight, so a weight-gradient GEMM hides the reduce-scatter before it
  and the iteration ends when the last reduce-scatter does;
- the layer's tensor-parallel collectives share that stream: after each sub-layer's row
  projection (forward) and column projection's input gradient (backward), waited for at once
  by Megatron's all-reduces and Megatron-SP's reduce-scatters, at the next sub-layer's end by
  the deferred and ring schedules.

A layer's exposed FSDP time is, per direction, the replay with FSDP's collectives less the same
replay without them: the tensor collectives' own exposure stays with `LayerModel`, and what the
two streams' contention adds is FSDP's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner.cost.layer_cost import LayerModel, comm_pattern
from oases_jax.planner.cost.layer_work import elem_bytes, weight_matrices
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout
from oases_jax.streams import Op, replay

# The tensor collectives a sub-layer's compute waits for at once (`layer_cost.comm_pattern`).
BLOCKING = ("all_reduce", "gather_scatter")


def layer_exposed(cfg: ModelConfig, layout: Layout, hw: Hardware,
                  strategy: LayerSpec) -> tuple[float, float, float]:
    """(forward, backward, collectives) seconds of one layer's FSDP traffic for one micro-batch:
    what the forward and the backward (recomputation included) wait for beyond the same layer
    without FSDP, and the collectives' total time."""
    chain = _Chain.build(cfg, layout, hw, strategy)
    (f1, b1), (f0, b0) = chain.directions(True), chain.directions(False)
    total = 2 * sum(chain.gathers.values()) + sum(chain.scatters.values())
    return max(f1 - f0, 0.0), max(b1 - b0, 0.0), total


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Chain:
    """One layer's loop iteration as the ops XLA's scheduler runs it, per weight matrix (by
    name): the compute that needs it, its FSDP gather and gradient reduce-scatter, and the
    sub-layers' tensor collectives."""

    order: tuple[str, ...]  # the matrices in forward order
    bwd_order: tuple[str, ...]  # in the order the backward uses them
    fwd_work: dict[str, float]  # forward compute that needs each matrix
    before: dict[str, float]  # forward compute before a matrix's own (pre-norm, core)
    between: dict[str, float]  # backward compute after a matrix's input gradient
    gathers: dict[str, float]  # seconds of each matrix's all-gather
    scatters: dict[str, float]  # seconds of each matrix's gradient reduce-scatter
    pattern: str  # `layer_cost.comm_pattern` of the tensor collectives ("none" without)
    tp_f: float  # a sub-layer's tensor collectives, forward
    tp_b: float  # and backward
    remat: bool
    redo: float  # the recomputed forward's compute (as the layer model counts it)
    mlp_first: str  # the MLP's first matrix: its input gradient ends the MLP's backward
    norm_bwd: float  # attention's norm backward, before the weight gradients

    @classmethod
    def build(cls, cfg: ModelConfig, layout: Layout, hw: Hardware,
              strategy: LayerSpec) -> _Chain:
        """The chain of one layer of `cfg` under `layout` and `strategy` on `hw`."""
        t, e = layout.tensor, elem_bytes(cfg)
        group = [i * t for i in range(layout.fsdp)]
        attn, mlp = weight_matrices(cfg)
        vectors = cfg.param_count(embeddings=False) / cfg.n_layers \
            - sum(p for _, p in attn + mlp)
        lm = LayerModel(cfg, layout, hw)
        work = lm.sublayers(layout.rows, strategy)
        a, m = work["attn"], work["mlp"]
        pattern = comm_pattern(strategy.schedule) if t > 1 else "none"
        tp_f = tp_b = 0.0
        if pattern != "none":  # the layer model's tensor collectives, half per sub-layer
            ops = lm.layer_ops(strategy)
            tp_f = replay(ops["fwd"])[2] / 2
            tp_b = replay(ops["recompute"] + ops["bwd"])[2] / 2
        # Forward compute that needs each matrix (the pre-norm and the core ride with the
        # matrix before/after them).
        fwd_work = dict(zip([n for n, _ in attn[:3]], _share(a.col, attn[:3]), strict=True))
        fwd_work["o"] = a.row
        cols = mlp[:-1]
        fwd_work.update(zip([n for n, _ in cols], _share(m.col, cols), strict=True))
        fwd_work[mlp[-1][0]] = m.row
        # Each sub-layer's first gather also carries half the layer's vectors, at 4 bytes.
        extra = {attn[0][0]: vectors * 4 / 2, mlp[0][0]: vectors * 4 / 2}
        redo = sum(w.pre + w.core + w.col + w.row for w in (a, m)) \
            if strategy.remat == "full" else sum(w.pre + w.core for w in (a, m))
        return cls(
            order=tuple(n for n, _ in attn + mlp),
            bwd_order=tuple(n for n, _ in mlp[::-1] + attn[::-1]),
            fwd_work=fwd_work,
            before={attn[0][0]: a.pre, "o": a.core, cols[0][0]: m.pre, mlp[-1][0]: m.core},
            # Between the matrices in the backward: the activation's backward after the down
            # projection's, the MLP's norm after its first matrix, attention's core after the
            # output projection's.
            between={mlp[-1][0]: m.core_bwd, mlp[0][0]: 2 * m.pre, attn[-1][0]: a.core_bwd},
            gathers={n: hw.comm_s("all-gather", (p * e + extra.get(n, 0.0)) / t, group)
                     for n, p in attn + mlp},
            scatters={n: hw.comm_s("reduce-scatter", p * e / t, group) for n, p in attn + mlp},
            pattern=pattern, tp_f=tp_f, tp_b=tp_b, remat=strategy.remat != "none", redo=redo,
            mlp_first=mlp[0][0], norm_bwd=2 * a.pre)

    def directions(self, fsdp: bool) -> tuple[float, float]:
        """(forward, backward) seconds of the iteration, with FSDP's collectives or without."""
        gathers = {n: s if fsdp else 0.0 for n, s in self.gathers.items()}
        scatters = {n: s if fsdp else 0.0 for n, s in self.scatters.items()}
        return self.forward(gathers), self.backward(gathers, scatters)

    def forward(self, gathers: dict[str, float]) -> float:
        """Each gather issued once the one before it is done; the last only before its own
        use."""
        order, last, pending = self.order, self.order[-1], []
        ops: list[Op] = [("start", order[0], gathers[order[0]])]
        for i, n in enumerate(order):
            ops += [("c", self.before.get(n, 0.0))]
            if n == last:
                ops += [("start", n, gathers[n])]
            ops += [("done", n)]
            if i + 1 < len(order) - 1:
                ops += [("start", order[i + 1], gathers[order[i + 1]])]
            ops += [("c", self.fwd_work[n])]
            if n in ("o", last):
                ops += _tensor(self.pattern, f"t{n}", self.tp_f, pending)
        return replay(ops + [("sync",)])[0]

    def backward(self, gathers: dict[str, float], scatters: dict[str, float]) -> float:
        """dX (needing the weights) first, under remat after the recomputation that waits for
        the gathers in forward order; then each dW and its reduce-scatter."""
        use, pending = (self.order if self.remat else self.bwd_order), []
        ops: list[Op] = [("start", use[0], gathers[use[0]])]
        if self.remat:  # the recomputed forward (its compute as the layer model counts it)
            total = sum(self.fwd_work.values())
            for i, n in enumerate(self.order):
                ops += _wait_then_next(use, gathers, i) \
                    + [("c", self.redo * self.fwd_work[n] / total)]
        for i, n in enumerate(self.bwd_order):
            if not self.remat:
                ops += _wait_then_next(use, gathers, i)
            ops += [("c", self.fwd_work[n]), ("c", self.between.get(n, 0.0))]
            # a sub-layer's input gradient is complete
            if n in (self.mlp_first, self.bwd_order[-1]):
                ops += _tensor(self.pattern, f"t{n}", self.tp_b, pending)
        ops += [("c", self.norm_bwd)]
        prev = None
        for n in self.bwd_order:
            ops += [("c", self.fwd_work[n])] + ([("done", prev)] if prev else [])
            prev = "rs" + n
            ops += [("start", prev, scatters[n])]
        return replay(ops + [("sync",)])[0]


def _share(total: float, mats: list[tuple[str, int]]) -> list[float]:
    """`total` split over the matrices `mats` by their parameters."""
    n = sum(p for _, p in mats)
    return [total * p / n for _, p in mats]


def _tensor(pattern: str, key: str, seconds: float, pending: list[str]) -> list[Op]:
    """A sub-layer's tensor collectives: waited for at once, or at the next one's end."""
    if seconds <= 0:
        return []
    if pattern in BLOCKING:
        return [("start", key, seconds), ("done", key)]
    out = [("done", k) for k in pending] + [("start", key, seconds)]
    pending[:] = [key]
    return out


def _wait_then_next(use: Sequence[str], gathers: dict[str, float], i: int) -> list[Op]:
    """Wait for the gather of matrix `use[i]`, then issue the next one's."""
    nxt = [("start", use[i + 1], gathers[use[i + 1]])] if i + 1 < len(use) else []
    return [("done", use[i])] + nxt
