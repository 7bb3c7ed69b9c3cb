"""FSDP's weight gathers and gradient reduce-scatters inside one layer's loop iteration, as XLA's
GPU scheduler orders them, priced by the two-stream replay (`planner.replay`).

Read off the compiled layer loops (`benchmarks/fsdp_layer_replay.py`: GPT-2 1.5B and Llama-2 7B,
`data=8` and `data=4,tensor=2` under fsdp on `h100:8`, one iteration of each loop replayed alone):

- the gathers of one iteration run one after another on the one collective stream, and nothing
  is gathered for the next iteration (no cross-iteration prefetch), so the first weight matrix
  an iteration uses is waited for whole;
- forward: every matrix but the last is gathered back to back from the iteration's start, each
  waited for right before its own GEMM; the last (the MLP's down projection) is issued only
  after the MLP's column GEMMs and waited for at once;
- backward: the matrices are gathered in the order the backward uses them (the MLP's first,
  then attention's; under remat in the recomputation's order), the first waited for at once;
  each matrix's gradient is reduce-scattered after its weight-gradient GEMM, queued behind the
  gathers, and the iteration ends when the last reduce-scatter does.

So a layer's exposed FSDP time is the replay's time minus its compute, per direction. The
layers' own tensor-parallel collectives are priced by `LayerModel` and added beside it.
"""

from __future__ import annotations

from models.config import ModelConfig
from oases_jax.layer_plan import LayerSpec
from planner.layer_work import LayerWork, elem_bytes
from planner.layout import Layout
from planner.prices import Hardware
from planner.replay import Op, replay


def _matrices(cfg: ModelConfig) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(attention, MLP) weight matrices of one layer in forward order, (name, parameters)."""
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k_dim, cfg.ff_dim
    attn = [("q", d * h * k), ("k", d * g * k), ("v", d * g * k), ("o", h * k * d)]
    mlp = [("gate", d * f), ("up", d * f), ("down", f * d)] if cfg.gated_mlp \
        else [("fc1", d * f), ("fc2", f * d)]
    return attn, mlp


def layer_exposed(cfg: ModelConfig, layout: Layout, hw: Hardware,
                  strategy: LayerSpec) -> tuple[float, float, float]:
    """(forward, backward, collectives) seconds of one layer's FSDP traffic for one micro-batch:
    what the forward and the backward (recomputation included) wait for beyond their compute,
    and the collectives' total time."""
    t, e = layout.tensor, elem_bytes(cfg)
    group = [i * t for i in range(layout.fsdp)]
    attn, mlp = _matrices(cfg)
    vectors = cfg.param_count(embeddings=False) / cfg.n_layers \
        - sum(p for _, p in attn + mlp)
    work = LayerWork(cfg, layout, hw).sublayers(layout.rows, strategy)
    a, m = work["attn"], work["mlp"]

    def share(total: float, mats: list[tuple[str, int]]) -> list[float]:
        n = sum(p for _, p in mats)
        return [total * p / n for _, p in mats]

    # Forward compute that needs each matrix (the pre-norm and the core ride with the matrix
    # before/after them).
    fwd_work = dict(zip([n for n, _ in attn[:3]], share(a.col, attn[:3]), strict=True))
    fwd_work["o"] = a.row
    cols = mlp[:-1]
    fwd_work.update(zip([n for n, _ in cols], share(m.col, cols), strict=True))
    fwd_work[mlp[-1][0]] = m.row
    before = {attn[0][0]: a.pre, "o": a.core, cols[0][0]: m.pre, mlp[-1][0]: m.core}

    def gather_s(name: str, params: int) -> float:
        extra = vectors * 4 / 2 if name in (attn[0][0], mlp[0][0]) else 0.0
        return hw.comm_s("all-gather", (params * e + extra) / t, group)

    gathers = {n: gather_s(n, p) for n, p in attn + mlp}
    order = [n for n, _ in attn + mlp]

    # Forward: each gather issued once the one before it is done (one in flight), so it hides
    # behind the previous matrix's GEMM; the last issued only before its own use.
    last = order[-1]
    ops: list[Op] = [("start", order[0], gathers[order[0]])]
    for i, n in enumerate(order):
        ops += [("c", before.get(n, 0.0))]
        if n == last:
            ops += [("start", n, gathers[n])]
        ops += [("done", n)]
        if i + 1 < len(order) - 1:
            ops += [("start", order[i + 1], gathers[order[i + 1]])]
        ops += [("c", fwd_work[n])]
    fwd_time, fwd_compute, fwd_comm = replay(ops)

    # Backward: dX needs the weights, dW the saved input; each matrix's gradient is
    # reduce-scattered after its dW, one reduce-scatter in flight. Under remat the
    # recomputation waits for the gathers, in forward order.
    bwd_order = [n for n, _ in mlp[::-1] + attn[::-1]]
    remat = strategy.remat != "none"
    use = order if remat else bwd_order
    ops = [("start", use[0], gathers[use[0]])]

    def wait_then_next(i: int) -> list[Op]:
        nxt = [("start", use[i + 1], gathers[use[i + 1]])] if i + 1 < len(use) else []
        return [("done", use[i])] + nxt

    if remat:  # the recomputed forward (its compute as the layer model counts it) first
        redo = sum(w.pre + w.core + w.col + w.row for w in (a, m)) \
            if strategy.remat == "full" else sum(w.pre + w.core for w in (a, m))
        total = sum(fwd_work.values())
        for i, n in enumerate(order):
            ops += wait_then_next(i) + [("c", redo * fwd_work[n] / total)]
    # Between the matrices: the activation's backward after the down projection's, the MLP's
    # norm after its first matrix, attention's core after the output projection's.
    between = {mlp[-1][0]: m.core_bwd, mlp[0][0]: 2 * m.pre, attn[-1][0]: a.core_bwd}
    params = dict(attn + mlp)
    # Each matrix's dX then dW; its gradient's reduce-scatter is ready after its dW. None
    # starts before the last gather is done; from then on one is issued after each compute op
    # once the one before it is done, and the rest after the last compute.
    ready: list[tuple[str, float]] = []
    gathered = remat
    prev = None

    def issue() -> list[Op]:
        nonlocal prev
        if not (gathered and ready):
            return []
        name, secs = ready.pop(0)
        out = ([("done", prev)] if prev else []) + [("start", name, secs)]
        prev = name
        return out

    for i, n in enumerate(bwd_order):
        if not remat:
            ops += wait_then_next(i)
            gathered = i == len(bwd_order) - 1
        for part in (fwd_work[n], fwd_work[n], between.get(n, 0.0)):
            ops += issue() + [("c", part)]
        ready.append(("rs" + n, hw.comm_s("reduce-scatter", params[n] * e / t, group)))
    ops += issue() + [("c", 2 * a.pre)]
    while ready:
        ops += issue()
    ops += [("sync",)]
    bwd_time, bwd_compute, bwd_comm = replay(ops)
    return (fwd_time - fwd_compute, bwd_time - bwd_compute, fwd_comm + bwd_comm)
