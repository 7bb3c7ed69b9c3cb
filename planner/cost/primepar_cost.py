"""PrimePar in the planner: the square layouts, one layer's op lists on the q x q square (every
projection q steps of max(step GEMM, step transfers)), its memory, and what the embedding and
the head add. The primitive itself: `oases_jax.primepar`; the formulas: docs/planner.md.

Notation: q the square's side, T = rows x seq the tokens of one data replica's micro-batch
(each device holds T/q of them: the batch is split over data x tp_row), e bytes per element of
the compute dtype, D the model width, V the padded vocabulary. A projection Y = X W has X
[T, K], W [K, N]; per device and step it multiplies [T/q, K/q] by [K/q, N/q].
"""

from __future__ import annotations

from collections.abc import Sequence

from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner.cost.layer_work import (
    SCAN_PASSES,
    SCHEDULE_PASSES,
    WEIGHT_SLICE_PASSES,
    LayerWork,
    elem_bytes,
)
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout, col_group, row_group
from oases_jax.streams import Op

SCHEDULE = "primepar"
SIDES = (2, 4)  # square sides the search proposes


# Layouts.


def square_layouts(cfg: ModelConfig, n_devices: int, global_batch: int, seq_len: int,
                   max_microbatches: int = 8) -> list[Layout]:
    """Every data x q x q = n_devices with q in `SIDES` dividing D, the heads, KV heads, MLP
    width and padded vocabulary, and every power-of-two micro-batch count whose micro-batch
    splits over data x q (the batch is sharded over both)."""
    out = []
    for q in SIDES:
        dims = (cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.ff_dim, cfg.padded_vocab)
        if n_devices % (q * q) or any(n % q for n in dims):
            continue
        d = n_devices // (q * q)
        if global_batch % (d * q):
            continue
        per_replica = global_batch // d
        m = 1
        while m <= min(max_microbatches, per_replica // q):
            if per_replica % (m * q) == 0:
                out.append(Layout(data=d, tensor=q * q, microbatches=m, global_batch=global_batch,
                                  seq_len=seq_len, primepar=True))
            m *= 2
    return out


def check(layout: Layout, strategy: LayerSpec) -> None:
    if layout.primepar != (strategy.schedule == SCHEDULE):
        raise ValueError(f"schedule {strategy.schedule!r} on layout {layout.label()}: primepar "
                         "runs on primepar layouts (a tp_row x tp_col square) and only there")


def projections(cfg: ModelConfig) -> dict[str, tuple[tuple[int, int], tuple[int, int]]]:
    """Per sub-layer, (K, N) of its column projection and of its row projection:
    attention  column D x (H + 2G) K_h,   row H K_h x D
    MLP        column D x (g - 1) F,      row F x D      (g = 3 gated, 2 otherwise)"""
    d, h, g, k, f = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.k_dim, cfg.ff_dim
    gated = 3 if cfg.gated_mlp else 2
    return {"attn": ((d, (h + 2 * g) * k), (h * k, d)), "mlp": ((d, (gated - 1) * f), (f, d))}


class Square:
    """Costs of one primepar layer: `LayerModel.layer_ops`, `saved_bytes` and `temp_bytes`
    hand primepar strategies here. `lm` is the layer's work (`LayerWork`, such as a
    `planner.cost.layer_cost.LayerModel`)."""

    def __init__(self, lm: LayerWork):
        self.lm, self.cfg, self.layout, self.hw = lm, lm.cfg, lm.layout, lm.hw
        self.q, self.e = lm.layout.square, lm.e
        self.tok = lm.layout.rows * lm.layout.seq_len  # T

    # Single operations.
    def step_gemm(self, k: int, n: int) -> float:
        """One step's GEMM [T/q, K/q] x [K/q, N/q]: 2 T K N / q^3 FLOPs and
        e (T K + K N + T N) / q^2 bytes; priced as 1/q of the q-chunk GEMM (the profile's
        per-call overhead included)."""
        q, t, e = self.q, self.tok, self.e
        flops, nbytes = 2.0 * t * k * n / q**3, e * (t * k + k * n + t * n) / q**2
        return self.hw.gemm_s(q * flops, q * nbytes, self.cfg.dtype, chunks=q) / q

    def perm(self, nbytes: float, along: str) -> float:
        """A shift to the ring neighbour along tp_row ("row") or tp_col ("col")."""
        group = row_group(self.q) if along == "row" else col_group(self.q)
        return self.hw.comm_s("collective-permute", nbytes, group)

    def blocks(self, k: int, n: int) -> dict[str, float]:
        """Bytes of one block: activation-side [T/q, K/q] (x) and [T/q, N/q] (y), weight-side
        [K/q, N/q] (w; weights are cast to the compute dtype first, partial dW too)."""
        q, t, e = self.q, self.tok, self.e
        return {"x": t * k / q**2 * e, "y": t * n / q**2 * e, "w": k * n / q**2 * e}

    # Steps.
    def _steps(self, key: str, steps: Sequence[tuple[float, Sequence[tuple[str, float]]]]
               ) -> list[Op]:
        """Each step issues its transfers, runs its GEMM(s) and waits for the transfers."""
        ops: list[Op] = []
        for i, (compute, transfers) in enumerate(steps):
            names = [f"{key}.{i}.{tag}" for tag, _ in transfers]
            ops += [("start", nm, s) for nm, (_, s) in zip(names, transfers, strict=True)]
            ops.append(("c", compute))
            ops += [("done", nm) for nm in names]
        return ops

    def column_fwd(self, key: str, k: int, n: int) -> list[Op]:
        """X stationary: step t in 0..q-1 multiplies, sends its W block down the rows (t < q-1)
        and the partial Y it received right along the columns (t > 0)."""
        q, b, g = self.q, self.blocks(k, n), self.step_gemm(k, n)
        w, p = self.perm(b["w"], "row"), self.perm(b["y"], "col")
        return self._steps(key, [(g, [("w", w)] * (t < q - 1) + [("p", p)] * (t > 0))
                                 for t in range(q)])

    def column_bwd(self, key: str, k: int, n: int) -> list[Op]:
        """Step 0: dW GEMM while dY moves left and W up; steps 1..q-1: dX and dW GEMMs while dY
        and W move on (t < q-1) and the partial dW moves up; a last dX GEMM."""
        q, b, g = self.q, self.blocks(k, n), self.step_gemm(k, n)
        dy, w, pw = self.perm(b["y"], "col"), self.perm(b["w"], "row"), self.perm(b["w"], "row")
        steps = [(g, [("dy", dy), ("w", w)])]
        steps += [(2 * g, [("dy", dy), ("w", w)] * (t < q - 1) + [("pw", pw)])
                  for t in range(1, q)]
        return self._steps(key, steps + [(g, [])])

    def row_fwd(self, key: str, k: int, n: int) -> list[Op]:
        """Cannon: step t multiplies while its X block moves left and W up (t < q-1)."""
        q, b, g = self.q, self.blocks(k, n), self.step_gemm(k, n)
        x, w = self.perm(b["x"], "col"), self.perm(b["w"], "row")
        return self._steps(key, [(g, [("x", x), ("w", w)] * (t < q - 1)) for t in range(q)])

    def row_bwd(self, key: str, k: int, n: int) -> list[Op]:
        """Step 0: dW GEMM while W moves down and X right; steps 1..q-1: dX and dW GEMMs while W
        and X move on (t < q-1), the partial dW moves down and the partial dX right (t >= 2);
        a last dX GEMM while the last partial dX moves."""
        q, b, g = self.q, self.blocks(k, n), self.step_gemm(k, n)
        w, x = self.perm(b["w"], "row"), self.perm(b["x"], "col")
        pw, px = self.perm(b["w"], "row"), self.perm(b["x"], "col")
        steps = [(g, [("w", w), ("x", x)])]
        steps += [(2 * g, [("w", w), ("x", x)] * (t < q - 1) + [("pw", pw)]
                   + [("px", px)] * (t >= 2)) for t in range(1, q)]
        return self._steps(key, steps + [(g, [("px", px)])])

    # The layer.
    def norm_stats(self) -> int:
        """All-reduces over tp_col per norm and direction: mean and variance (LayerNorm) or the
        mean square (RMSNorm) forward, as many reductions of dY backward."""
        return 1 if self.cfg.family == "llama" else 2

    def _stat_ops(self, key: str) -> list[Op]:
        s = self.hw.comm_s("all-reduce", 4 * self.tok / self.q, col_group(self.q))
        return [op for i in range(self.norm_stats())
                for op in (("start", f"{key}.s{i}", s), ("done", f"{key}.s{i}"))]

    def _bias_skews(self, name: str) -> list[float]:
        """Seconds of the permutes that skew a column projection's biases (q, k, v; MLP in) to
        its output's layout (forward), and their gradients back (backward): N/q fp32 each."""
        if not self.cfg.use_bias:
            return []
        c, q = self.cfg, self.q
        sizes = ([c.n_heads * c.k_dim] + 2 * [c.kv_heads * c.k_dim] if name == "attn"
                 else [c.ff_dim])
        return [self.perm(4 * s / q, "col") for s in sizes]

    def work(self, strategy: LayerSpec) -> dict:
        """Per sub-layer: the norm's memory work 5 T D e / q^2 (the residual stream is split
        q^2 ways) and the core (attention or activation on T/q rows and 1/q of the heads or
        MLP width: `LayerModel.sublayers` at tensor q^2)."""
        subs = self.lm.sublayers(self.layout.rows, strategy)
        pre = self.hw.mem_s(5 * self.tok * self.cfg.d_model * self.e / self.q**2)
        return {name: (pre, sub.core, sub.core_bwd) for name, sub in subs.items()}

    def fwd(self, strategy: LayerSpec, tag: str = "", norms: bool = True) -> list[Op]:
        ops: list[Op] = []
        for name, (pre, core, _) in self.work(strategy).items():
            (kc, nc), (kr, nr) = projections(self.cfg)[name]
            key = f"{tag}{name}"
            if norms:
                ops += [("c", pre)] + self._stat_ops(key)
            skews = self._bias_skews(name)
            ops += [("start", f"{key}.b{i}", s) for i, s in enumerate(skews)]
            ops += self.column_fwd(f"{key}.col", kc, nc)
            ops += [("done", f"{key}.b{i}") for i in range(len(skews))]
            ops += [("c", core)] + self.row_fwd(f"{key}.row", kr, nr)
        return ops

    def bwd(self, strategy: LayerSpec) -> list[Op]:
        ops: list[Op] = []
        for name, (pre, _, core_bwd) in reversed(self.work(strategy).items()):
            (kc, nc), (kr, nr) = projections(self.cfg)[name]
            key = f"b{name}"
            ops += self.row_bwd(f"{key}.row", kr, nr) + [("c", core_bwd)]
            skews = self._bias_skews(name)
            ops += [("start", f"{key}.b{i}", s) for i, s in enumerate(skews)]
            ops += self.column_bwd(f"{key}.col", kc, nc)
            ops += [("done", f"{key}.b{i}") for i in range(len(skews))]
            ops += [("c", 2 * pre)] + self._stat_ops(key)
        return ops + self._param_grad_ops()

    def _param_grad_ops(self) -> list[Op]:
        """The norms' and biases' gradients are sums over tokens, which tp_row splits: one
        all-reduce over tp_row of their local 1/q (fp32) per layer."""
        c = self.cfg
        n = 2 * c.d_model * (2 if c.use_bias else 1)
        if c.use_bias:
            n += (c.n_heads + 2 * c.kv_heads) * c.k_dim + c.ff_dim + 2 * c.d_model
        s = self.hw.comm_s("all-reduce", 4 * n / self.q, row_group(self.q))
        return [("start", "bparams", s), ("done", "bparams")]

    def layer_ops(self, strategy: LayerSpec) -> dict[str, list[Op]]:
        """Forward, backward and recomputation of one layer; see the module and method
        docstrings. Recomputation: `full` redoes the forward; `save_proj` redoes every
        projection's forward, transfers included (their custom-VJP residuals, the input block
        and the row projection's last rotated block, carry no checkpoint name), and the cores,
        but not the norms."""
        check(self.layout, strategy)
        scan = slices = 0.0
        if self.cfg.scan_layers:  # stacking the saved activations and slicing the weights, as
            # for the other schedules (`planner.cost.layer_cost`)
            scan = self.hw.mem_s(SCAN_PASSES * self.saved_bytes(strategy))
            slices = self.hw.mem_s(WEIGHT_SLICE_PASSES * self.lm.weight_bytes())
        # The schedule's own passes over its residual stream, T D e / q^2 (none calibrated yet).
        tok_bytes = self.tok * self.cfg.d_model * self.e / self.q**2
        extra = self.hw.mem_s(SCHEDULE_PASSES[SCHEDULE] * tok_bytes)
        fwd = [("c", scan / 2 + slices / 3 + extra / 2)] + self.fwd(strategy)
        bwd = [("c", scan / 2 + 2 * slices / 3 + extra / 2)] + self.bwd(strategy)
        recompute = {"none": [], "full": self.fwd(strategy, "r"),
                     "save_proj": self.fwd(strategy, "r", norms=False)}[strategy.remat]
        return {"fwd": fwd, "bwd": bwd, "recompute": recompute}

    # Memory.
    def saved_bytes(self, strategy: LayerSpec) -> float:
        """Activations one layer keeps for its backward, bytes per device: the other schedules'
        formulas with every tensor split q^2 ways (nothing is replicated over the square):
          none:      [4 T D + T (H + 2G) K + T H K + T L H + g T F] e / q^2 + 4 T L H / q^2
                     (the row projections keep their last rotated input block instead of their
                     input: the same size)
          save_proj: [5 T D + T (H + 2G) K + (g - 1) T F] e / q^2
          full:      T D e / q^2
        """
        check(self.layout, strategy)
        c, q2, e, t = self.cfg, self.q**2, self.e, self.tok
        d, h, g, k, f = c.d_model, c.n_heads, c.kv_heads, c.k_dim, c.ff_dim
        gated = 3 if c.gated_mlp else 2
        if strategy.remat == "full":
            return t * d * e / q2
        if strategy.remat == "save_proj":
            return (5 * t * d + t * (h + 2 * g) * k + (gated - 1) * t * f) * e / q2
        scores = t * self.layout.seq_len * h / q2
        return (4 * t * d + t * (h + 2 * g) * k + t * h * k + gated * t * f) * e / q2 \
            + scores * e + 4 * scores

    def score_copy_bytes(self) -> float:
        """The f32 scores a layer saves for its softmax's backward, 4 T L H / q^2
        (`LayerModel.score_copy_bytes`)."""
        return 4 * self.tok * self.layout.seq_len * self.cfg.n_heads / self.q**2

    def temp_bytes(self, strategy: LayerSpec) -> float:
        """Working set of the layer's backward beyond its saved activations: the f32 scores and
        their gradient (2 * 4 T L H / q^2), the recomputed activations under remat, and the
        rotation's blocks: two of every block a backward step moves (the one in use and the one
        arriving), for the largest projection: column dY + W + partial dW
        (T N + 2 K N) e / q^2, row X + W + partial dW + partial dX (2 T K + 2 K N) e / q^2."""
        check(self.layout, strategy)
        c, q2 = self.cfg, self.q**2
        scores = self.tok * self.layout.seq_len * c.n_heads / q2
        temp = 2 * 4 * scores
        if strategy.remat != "none":
            temp += self.saved_bytes(LayerSpec(schedule=SCHEDULE))
        moving = 0.0
        for (kc, nc), (kr, nr) in projections(c).values():
            col, row = self.blocks(kc, nc), self.blocks(kr, nr)
            moving = max(moving, col["y"] + 2 * col["w"], 2 * row["x"] + 2 * row["w"])
        return temp + 2 * moving


# The embedding and the head.


def head_extra(cfg: ModelConfig, layout: Layout, hw: Hardware) -> tuple[float, float]:
    """(seconds, temp bytes) the embedding and the head add under primepar, per micro-batch.

    Their tables are [V, D] with V over tp_col and D over tp_row, the hidden state [T/q, D/q];
    XLA's partitioner gathers the table over tp_col for the lookup (V D / q fp32), the head's
    weight over tp_row (V D / q fp32) and the hidden state over tp_col (T D / q e) for the
    logits, and all-reduces the head weight's gradient over tp_row and dX over tp_col:

        exposed = AG_col(T D e / q) + AR_col(T D e / q) + AG_col(V D 4 / q)
                  + [AG_row(V D 4 / q) + AR_row(V D 4 / q)  on synchronous (CPU) clusters]

    With asynchronous collectives the head weight's gather and its gradient's all-reduce
    depend on no activation and run behind the forward and backward layer loops.
    Temp: the two gathered tables, 2 V D 4 / q.
    """
    q, e = layout.square, elem_bytes(cfg)
    d, v = cfg.d_model, cfg.padded_vocab
    hidden = layout.rows * layout.seq_len * d * e / q
    table = v * d * 4 / q
    cols, rows = col_group(q), row_group(q)
    exposed = (hw.comm_s("all-gather", hidden, cols) + hw.comm_s("all-reduce", hidden, cols)
               + hw.comm_s("all-gather", table, cols))
    weight = hw.comm_s("all-gather", table, rows) + hw.comm_s("all-reduce", table, rows)
    return exposed + (0.0 if hw.async_collectives else weight), 2 * table
