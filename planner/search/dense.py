"""The search: every mesh factorisation and micro-batch count, and for each an exact dynamic
program over the layer chain that picks each layer's strategy under the memory budget."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import numpy as np

from oases_jax import registry
from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.planner.cost.layer_cost import LayerCost, LayerModel
from oases_jax.planner.cost.layer_work import FITTED_SUB_BATCHES
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.cost.primepar_cost import SCHEDULE as PRIMEPAR
from oases_jax.planner.cost.primepar_cost import SIDES, square_layouts
from oases_jax.planner.cost.step_cost import (
    StepCost,
    gathered_layer_bytes,
    head_cost,
    resharding_s,
    static_memory,
    step_cost,
)
from oases_jax.planner.layout import Layout

SCHEDULES = registry.names(planned=True)  # the per-layer schedules the planner chooses from
REMATS = ("none", "save_proj", "full")  # the remat policies the cost model prices
MEMORY_BUCKETS = 256  # resolution of the DP's activation-memory axis (budget / 256)
SUB_BATCH_COUNTS = (2, 4)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class Candidate:
    layout: Layout
    strategies: tuple[LayerSpec, ...]
    cost: StepCost

    def summary(self) -> str:
        """e.g. `data=2,tensor=4: 4 x oases/2+none`, runs of equal strategies grouped."""
        runs: list[list] = []
        for s in self.strategies:
            if runs and runs[-1][1] == s:
                runs[-1][0] += 1
            else:
                runs.append([1, s])
        return f"{self.layout.label()}: " + ", ".join(f"{n} x {s.label()}" for n, s in runs)


@dataclasses.dataclass
class SearchResult:
    best: Candidate
    ranked: list[Candidate]  # best first, one per layout (and the uniform baselines)
    baselines: dict[str, Candidate]
    search_s: float
    layouts_considered: int
    budget_bytes: float


def layouts(cfg: ModelConfig, n_devices: int, global_batch: int, seq_len: int,
            max_microbatches: int = 8, schedules: Sequence[str] = SCHEDULES) -> list[Layout]:
    """Every replicas x tensor = n_devices with a tensor degree that divides the heads, KV
    heads, MLP width and vocabulary, the replicas either holding whole parameters or sharding
    them (fsdp over all replicas), and every power-of-two micro-batch count that divides the
    per-replica batch; with `primepar` among `schedules`, its square layouts too
    (`planner.cost.primepar_cost.square_layouts`), and with it alone only those."""
    out = []
    if PRIMEPAR in schedules:
        out += square_layouts(cfg, n_devices, global_batch, seq_len, max_microbatches)
        if set(schedules) == {PRIMEPAR}:
            return out
    for t in divisors(n_devices):
        if cfg.n_heads % t or cfg.kv_heads % t or cfg.ff_dim % t or cfg.padded_vocab % t:
            continue
        replicas = n_devices // t
        for f in sorted({1, replicas}):
            d = replicas // f
            if global_batch % (d * f):
                continue
            per_replica = global_batch // (d * f)
            m = 1
            while m <= min(max_microbatches, per_replica):
                if per_replica % m == 0:
                    out.append(Layout(data=d, fsdp=f, tensor=t, microbatches=m,
                                      global_batch=global_batch, seq_len=seq_len))
                m *= 2
    return out


def strategies(layout: Layout, schedules: Sequence[str] = SCHEDULES,
               remats: Sequence[str] = REMATS) -> list[LayerSpec]:
    """The per-layer choices valid on a layout: without tensor parallelism only the remat
    policy matters; sequence-parallel schedules need the sequence to split over the tensor axis
    and no fsdp axis; sub-batch counts must divide the micro-batch rows, and be counts the
    schedule's calibration holds for (`layer_work.FITTED_SUB_BATCHES`). A primepar layout
    offers primepar alone (its parameters' sharding is its own), the others never offer it."""
    if layout.primepar:
        return [LayerSpec(schedule=PRIMEPAR, remat=r) for r in remats] \
            if PRIMEPAR in schedules else []
    if layout.tensor == 1:
        return [LayerSpec(schedule="megatron", remat=r) for r in remats]
    out = []
    for sch in schedules:
        if sch == PRIMEPAR:
            continue
        spec = registry.get(sch)
        if spec.sequence_parallel and (layout.seq_len % layout.tensor or layout.fsdp > 1):
            continue
        fitted = FITTED_SUB_BATCHES.get(sch, SUB_BATCH_COUNTS)
        counts = [k for k in SUB_BATCH_COUNTS if layout.rows % k == 0 and k in fitted] \
            if spec.sub_batches else [1]
        out += [LayerSpec(schedule=sch, sub_batches=k, remat=r) for k in counts for r in remats]
    return out


def chain_dp(times: np.ndarray, mems: np.ndarray, edges: np.ndarray, n_layers: int,
             budget: float) -> tuple[float, list[int]] | None:
    """Exact DP over a chain of `n_layers` identical layers: choose strategy s_i per layer to
    minimise sum(times[s_i]) + sum(edges[s_i, s_{i+1}]) subject to sum(mems[s_i]) <= budget.
    Memory is counted in `MEMORY_BUCKETS` buckets of budget / MEMORY_BUCKETS, each layer's
    memory rounded up (so a returned chain always fits). None when nothing fits."""
    if budget <= 0:
        return None
    n = len(times)
    unit = budget / MEMORY_BUCKETS
    need = np.ceil(mems / unit - 1e-9).astype(int)
    m_axis = MEMORY_BUCKETS + 1
    inf = np.inf
    # dp[s, m]: best time of a chain ending in s using exactly m buckets.
    dp = np.full((n, m_axis), inf)
    for s in range(n):
        if need[s] < m_axis:
            dp[s, need[s]] = times[s]
    src = np.arange(m_axis)[None, :] - need[:, None]  # [s, m] -> m - need[s]
    valid = src >= 0
    src = np.clip(src, 0, None)
    back = []
    for _ in range(n_layers - 1):
        cand = dp[:, src] + edges[:, :, None]  # [prev, s, m]
        cand = np.where(valid[None], cand, inf)
        arg = np.argmin(cand, axis=0)  # [s, m]
        best = np.take_along_axis(cand, arg[None], axis=0)[0] + times[:, None]
        back.append(arg)
        dp = best
    s, m = np.unravel_index(np.argmin(dp), dp.shape)
    total = dp[s, m]
    if not np.isfinite(total):
        return None
    chain = [int(s)]
    for arg in reversed(back):
        prev = int(arg[s, m])
        m = m - need[s]
        s = prev
        chain.append(s)
    return float(total), chain[::-1]


def plan_layout(cfg: ModelConfig, layout: Layout, hw: Hardware, budget: float,
                schedules: Sequence[str] = SCHEDULES,
                remats: Sequence[str] = REMATS, lower_bound: float | None = None,
                ) -> tuple[Candidate | None, dict[LayerSpec, Candidate]]:
    """The best per-layer chain on one layout, and the best uniform plan of each schedule (all
    under the budget). The DP runs per temporary-memory threshold, since the peak holds the
    largest working set of any layer in the chain."""
    lm = LayerModel(cfg, layout, hw)
    strats = strategies(layout, schedules, remats)
    if not strats:
        return None, {}
    costs: dict[LayerSpec, LayerCost] = {s: lm.time(s) for s in strats}
    # What each layer keeps from its forward to its backward: activations, and under fsdp the
    # weights an overlapped layer gathered (`gathered_layer_bytes`).
    kept = {s: costs[s].act_bytes + gathered_layer_bytes(cfg, layout, s) for s in strats}
    static = sum(static_memory(cfg, layout).values())
    _, head_temp = head_cost(cfg, layout, hw)

    def full(chain: Sequence[LayerSpec]) -> Candidate:
        return Candidate(layout, tuple(chain), step_cost(cfg, layout, chain, hw, costs))

    uniform: dict[LayerSpec, Candidate] = {}
    for s in strats:
        if static + max(costs[s].temp_bytes, head_temp) + cfg.n_layers * kept[s] <= budget:
            uniform[s] = full([s] * cfg.n_layers)
    best_uniform = min(uniform.values(), key=lambda c: c.cost.step_s, default=None)
    # Identical layers and non-negative edges: without a binding budget the best chain is
    # uniform. Otherwise mixing strategies (e.g. remat on some layers) can beat every uniform.
    fastest = min(strats, key=lambda s: costs[s].step_s)
    if best_uniform is not None and best_uniform.strategies[0] == fastest:
        return best_uniform, uniform
    if lower_bound is not None and cfg.n_layers * costs[fastest].step_s * layout.microbatches \
            >= lower_bound:
        return best_uniform, uniform  # no chain here can beat the best plan found so far
    best = best_uniform
    # A strategy slower, heavier and with a larger working set than another is never chosen:
    # drop it (exactness kept, the DP shrinks).
    keep = [s for s in strats if not any(
        o != s and costs[o].step_s <= costs[s].step_s and kept[o] <= kept[s]
        and costs[o].temp_bytes <= costs[s].temp_bytes for o in strats)]
    strats = keep
    times = np.array([costs[s].step_s for s in strats]) * layout.microbatches
    mems = np.array([kept[s] for s in strats])
    edges = np.array([[resharding_s(a, b, cfg, layout, hw) * layout.microbatches for b in strats]
                      for a in strats])
    temps = sorted({max(costs[s].temp_bytes, head_temp) for s in strats})
    for tau in temps:
        allowed = np.array([max(costs[s].temp_bytes, head_temp) <= tau for s in strats])
        t_allowed = np.where(allowed, times, np.inf)
        found = chain_dp(t_allowed, mems, edges, cfg.n_layers, budget - static - tau)
        if found is None:
            continue
        cand = full([strats[i] for i in found[1]])
        if cand.cost.peak_memory_bytes <= budget * (1 + 1e-9) and (
                best is None or cand.cost.step_s < best.cost.step_s):
            best = cand
    return best, uniform


def no_fit(what: str, budget: float, memory_fraction: float | None, smallest, n: int,
           cluster=None) -> UserError:
    """The one-line error when no `what` fits: the leanest candidate priced (`smallest`, with a
    `cost` and a `summary()`, or None) and about how many devices it would need. On CPUs it
    says the devices share the host's memory."""
    need = smallest.cost.peak_memory_bytes if smallest else float("nan")
    shared = (f", the {cluster.n_devices} CPU devices sharing this host's "
              f"{cluster.device_spec.memory_bytes / 2**30:.1f} GiB"
              if cluster is not None and cluster.device == "cpu" else "")
    return UserError(
        f"no {what} fits {budget / 2**30:.1f} GiB per device (memory fraction "
        f"{'default' if memory_fraction is None else memory_fraction}{shared}); the leanest "
        f"({smallest.summary() if smallest else '-'}) needs "
        f"{need / 2**30:.1f} GiB: use more devices (about "
        f"{int(np.ceil(n * need / budget))}), a smaller --global-batch, or more micro-batches")


def search(cfg: ModelConfig, hw: Hardware, *, global_batch: int, seq_len: int,
           memory_fraction: float | None = None, schedules: Sequence[str] = SCHEDULES,
           remats: Sequence[str] = REMATS, max_microbatches: int = 8,
           n_devices: int | None = None) -> SearchResult:
    """Search every layout; rank the best plan of each. Raises UserError with what would be
    needed when nothing fits."""
    t0 = time.perf_counter()
    n = n_devices or hw.cluster.n_devices
    if cfg.moe:  # its experts, dispatch and expert axis are not in this search's cost model
        raise ValueError("search() plans dense models; plan an MoE model with "
                         "planner.search.moe.search_moe (planner.make_plan chooses)")
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise UserError(f"--memory-fraction {memory_fraction} must be in (0, 1]")
    if seq_len > cfg.max_seq_len:
        raise UserError(f"--seq-len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    budget = hw.memory_budget(memory_fraction)
    cands = layouts(cfg, n, global_batch, seq_len, max_microbatches, schedules)
    if not cands and set(schedules) == {PRIMEPAR}:
        raise UserError(
            f"no primepar square fits {n} devices and --global-batch {global_batch}: it needs "
            f"data x q x q devices with q in {SIDES} dividing the model's width, heads, MLP "
            f"and vocabulary, and a batch divisible by data x q"
        )
    if not cands:
        raise UserError(
            f"no mesh of {n} devices splits --global-batch {global_batch} with a tensor degree "
            f"dividing the model's heads ({cfg.n_heads}); use a batch divisible by {n}"
        )
    ranked: list[Candidate] = []
    baselines: dict[str, Candidate] = {}
    smallest: Candidate | None = None
    for layout in cands:
        bound = None
        if ranked:  # only chains faster than the best so far are worth a DP
            bound = min(c.cost.step_s for c in ranked)
        best, uniform = plan_layout(cfg, layout, hw, budget, schedules, remats, bound)
        if best is not None:
            ranked.append(best)
        for s, c in uniform.items():
            key = "megatron" if layout.tensor == 1 or s.schedule == "megatron" else None
            if key and (key not in baselines or c.cost.step_s < baselines[key].cost.step_s):
                baselines[key] = c
            top = baselines.get("best_uniform")
            if top is None or c.cost.step_s < top.cost.step_s:
                baselines["best_uniform"] = c
        if best is None:
            lm = LayerModel(cfg, layout, hw)
            probe = LayerSpec(schedule=PRIMEPAR if layout.primepar else "megatron",
                             remat="full")
            c = step_cost(cfg, layout, [probe] * cfg.n_layers, hw, {probe: lm.time(probe)})
            if smallest is None or c.peak_memory_bytes < smallest.cost.peak_memory_bytes:
                smallest = Candidate(layout, (probe,) * cfg.n_layers, c)
    if not ranked:
        raise no_fit("plan", budget, memory_fraction, smallest, n, hw.cluster)
    ranked.sort(key=lambda c: c.cost.step_s)
    return SearchResult(best=ranked[0], ranked=ranked, baselines=baselines,
                        search_s=time.perf_counter() - t0, layouts_considered=len(cands),
                        budget_bytes=budget)
