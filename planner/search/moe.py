"""The MoE search: every data x expert x tensor layout (the expert degree dividing the experts,
data and expert in either order), micro-batch count, dense strategy and MoE schedule (ds_moe,
parm_s1, parm_s2 with its chunk count; `local` without an expert axis), priced by
`planner.cost.moe_step`, the fastest that fits the memory budget ranked per layout.

An MoE plan runs one dense strategy on every layer: the runtime scans (dense..., MoE) layer
groups under one segment (`oases_jax.moe.stack.run_groups`), so a per-layer tensor-parallel plan
does not apply to MoE models; the search chooses the dense parts' strategy for all layers."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec
from oases_jax.models.config import ModelConfig
from oases_jax.moe.stack import scan_schedules
from oases_jax.planner.cost.moe_step import (
    EP_SCHEDULES,
    MoEChoice,
    MoEStep,
    layer_costs,
    moe_choices,
    moe_step_cost,
)
from oases_jax.planner.cost.prices import Hardware
from oases_jax.planner.layout import Layout, data_group, expert_group
from oases_jax.planner.search.dense import REMATS, SCHEDULES, SearchResult, divisors, no_fit

# The dense schedules MoE layer groups run under: the planned ones that run in a plain scan.
DENSE_SCHEDULES = tuple(s for s in SCHEDULES if s in scan_schedules())
UNIFORM = ("MoE plans run one dense strategy on every layer: the runtime scans (dense..., MoE) "
           "layer groups under one segment, so per-layer strategies do not apply")


@dataclasses.dataclass(frozen=True)
class MoECandidate:
    """A priced MoE plan: its layout, the dense strategy of every layer and the MoE schedule."""

    layout: Layout
    dense: LayerSpec
    moe: MoEChoice
    step: MoEStep
    n_layers: int

    @property
    def cost(self):
        return self.step.cost

    @property
    def strategies(self) -> tuple[LayerSpec, ...]:
        return (self.dense,) * self.n_layers

    def summary(self) -> str:
        """e.g. `data=2,expert=2,tensor=2: 4 x megatron+none, moe parm_s2/2`."""
        return (f"{self.layout.label()}: {self.n_layers} x {self.dense.label()}, "
                f"moe {self.moe.label()}")


def moe_layouts(cfg: ModelConfig, n_devices: int, global_batch: int, seq_len: int,
                max_microbatches: int = 8, expert_degrees: Sequence[int] | None = None
                ) -> list[Layout]:
    """data x expert x tensor = n_devices: tensor dividing the heads, KV heads, both MLP widths
    and the vocabulary, and the sequence (the MoE schedules split tokens over tensor); expert
    dividing the experts (and in `expert_degrees` when given); data x expert dividing the
    batch; both orders of data and expert when both exceed 1; power-of-two micro-batches."""
    out = []
    for t in divisors(n_devices):
        if any(n % t for n in (cfg.n_heads, cfg.kv_heads, cfg.ff_dim, cfg.expert_ff_dim,
                               cfg.padded_vocab, seq_len)):
            continue
        for ep in divisors(n_devices // t):
            if cfg.n_experts % ep or (expert_degrees and ep not in expert_degrees):
                continue
            d = n_devices // (t * ep)
            if global_batch % (d * ep):
                continue
            per_replica = global_batch // (d * ep)
            for inner in ((True, False) if d > 1 and ep > 1 else (True,)):
                m = 1
                while m <= min(max_microbatches, per_replica):
                    if per_replica % m == 0:
                        out.append(Layout(data=d, expert=ep, tensor=t, microbatches=m,
                                          expert_inner=inner, global_batch=global_batch,
                                          seq_len=seq_len))
                    m *= 2
    return out


def dense_strategies(layout: Layout, schedules: Sequence[str], remats: Sequence[str]
                     ) -> list[LayerSpec]:
    """The dense strategies of a layout: megatron (x remat) without a tensor split, else each
    of `schedules` that MoE groups run under (x remat)."""
    if layout.tensor == 1:
        return [LayerSpec(schedule="megatron", remat=r) for r in remats]
    return [LayerSpec(schedule=s, remat=r) for s in schedules if s in DENSE_SCHEDULES
            for r in remats]


def check_options(cfg: ModelConfig, n_devices: int, schedules: Sequence[str],
                  expert_degrees: Sequence[int] | None, moe_schedules: Sequence[str]) -> None:
    """One-line errors for options no MoE plan can meet."""
    for ep in expert_degrees or ():
        if ep < 1 or cfg.n_experts % ep or n_devices % ep:
            raise UserError(f"--expert-degrees: expert degree {ep} must divide the model's "
                            f"{cfg.n_experts} experts and the {n_devices} devices; use one of "
                            f"{', '.join(map(str, _common_divisors(cfg.n_experts, n_devices)))}")
    bad = [s for s in moe_schedules if s not in EP_SCHEDULES]
    if bad:
        raise UserError(f"unknown MoE schedule {bad[0]!r} in --moe-schedules; choose from "
                        f"{', '.join(EP_SCHEDULES)}")
    if not any(s in DENSE_SCHEDULES for s in schedules):
        raise UserError(f"--schedules {','.join(schedules)}: none runs MoE layer groups; "
                        f"{UNIFORM} in a plain scan: use {', '.join(DENSE_SCHEDULES)}")


def _links(layout: Layout, hw: Hardware) -> tuple:
    """The links an expert group and a data group of the layout cross: where both orders of
    data and expert give the same, the search keeps only expert inside."""
    link = hw.cluster.link_for
    return link(expert_group(layout)), link(data_group(layout))


def _common_divisors(a: int, b: int) -> list[int]:
    return [d for d in divisors(a) if b % d == 0]


def plan_moe_layout(cfg: ModelConfig, layout: Layout, hw: Hardware, budget: float,
                    schedules: Sequence[str], remats: Sequence[str],
                    moe_schedules: Sequence[str]) -> list[MoECandidate]:
    """Every (dense strategy, MoE schedule) on one layout, priced; those that fit first,
    fastest first, then those that do not (by peak memory)."""
    out = []
    for dense in dense_strategies(layout, schedules, remats):
        costs = layer_costs(cfg, layout, dense, hw)
        for choice in moe_choices(cfg, layout, moe_schedules):
            out.append(MoECandidate(layout, dense, choice,
                                    moe_step_cost(cfg, layout, dense, choice, hw, costs),
                                    cfg.n_layers))
    fits = sorted((c for c in out if c.cost.peak_memory_bytes <= budget),
                  key=lambda c: c.cost.step_s)
    rest = sorted((c for c in out if c.cost.peak_memory_bytes > budget),
                  key=lambda c: c.cost.peak_memory_bytes)
    return fits + rest


def search_moe(cfg: ModelConfig, hw: Hardware, *, global_batch: int, seq_len: int,
               memory_fraction: float | None = None, schedules: Sequence[str] = SCHEDULES,
               remats: Sequence[str] = REMATS, max_microbatches: int = 8,
               n_devices: int | None = None, expert_degrees: Sequence[int] | None = None,
               moe_schedules: Sequence[str] = EP_SCHEDULES) -> SearchResult:
    """Search every MoE layout; rank the best plan of each. Baselines: `no_expert` (the best
    plan without an expert axis), `expert` (the best with one) and `ds_moe` (the best running
    DeepSpeed-MoE's schedule). Raises UserError with what would be needed when nothing fits."""
    t0 = time.perf_counter()
    n = n_devices or hw.cluster.n_devices
    if memory_fraction is not None and not 0 < memory_fraction <= 1:
        raise UserError(f"--memory-fraction {memory_fraction} must be in (0, 1]")
    if seq_len > cfg.max_seq_len:
        raise UserError(f"--seq-len {seq_len} exceeds the model's max_seq_len {cfg.max_seq_len}")
    check_options(cfg, n, schedules, expert_degrees, moe_schedules)
    budget = hw.memory_budget(memory_fraction)
    cands = moe_layouts(cfg, n, global_batch, seq_len, max_microbatches, expert_degrees)
    if not cands:
        raise UserError(
            f"no data x expert x tensor mesh of {n} devices splits --global-batch "
            f"{global_batch} x --seq-len {seq_len} with an expert degree dividing the "
            f"{cfg.n_experts} experts and a tensor degree dividing the heads ({cfg.n_heads}) and "
            f"the sequence; use a batch divisible by {n}")
    ranked: list[MoECandidate] = []
    baselines: dict[str, MoECandidate] = {}
    smallest: MoECandidate | None = None
    cands = [c for c in cands if c.expert_inner or _links(c, hw) != _links(
        dataclasses.replace(c, expert_inner=True), hw)]
    for layout in cands:
        priced = plan_moe_layout(cfg, layout, hw, budget, schedules, remats, moe_schedules)
        fits = [c for c in priced if c.cost.peak_memory_bytes <= budget]
        if fits:
            ranked.append(fits[0])
            keys = ["expert" if layout.expert > 1 else "no_expert"]
            ds = next((c for c in fits if c.moe.schedule == "ds_moe"), None)
            for key, c in [(keys[0], fits[0])] + ([("ds_moe", ds)] if ds else []):
                if key not in baselines or c.cost.step_s < baselines[key].cost.step_s:
                    baselines[key] = c
        elif priced and (smallest is None or priced[0].cost.peak_memory_bytes
                         < smallest.cost.peak_memory_bytes):
            smallest = priced[0]
    if not ranked:
        raise no_fit("MoE plan", budget, memory_fraction, smallest, n, hw.cluster)
    ranked.sort(key=lambda c: c.cost.step_s)
    return SearchResult(best=ranked[0], ranked=ranked, baselines=baselines,
                        search_s=time.perf_counter() - t0, layouts_considered=len(cands),
                        budget_bytes=budget)
