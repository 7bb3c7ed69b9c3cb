"""Verifying plans: compile the search's top plans for the target cluster through the one compile
path (`tools.inspection`), set each prediction beside the compiled program's figures, and choose
the fastest plan, by our simulator's step, whose compiled program fits the device's memory."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from oases_jax.errors import UserError
from oases_jax.hardware import COMPILE_FACTS, ClusterSpec, compile_targets
from oases_jax.models.config import ModelConfig
from oases_jax.planner import plan as plans
from oases_jax.planner.search.dense import Candidate, SearchResult
from oases_jax.targets import Target, get_target

CHOSEN_BY = "simulated_step_s"  # the opinion that ranks the verified plans that fit


@dataclasses.dataclass(frozen=True, kw_only=True)
class Verified:
    """One compiled candidate: the planner's prediction beside the compiled program's figures.
    The compiled figures are None when the compile failed (`error`)."""

    candidate: Candidate
    rank: int  # 1-based, by predicted step
    device_memory_bytes: float
    compiled_peak_memory_bytes: int | None = None
    simulated_step_s: float | None = None
    xla_step_s: float | None = None  # XLA's own estimate (GPU targets)
    gemm_overlap_share: float | None = None  # collective bytes with a GEMM in their window
    compile_s: float | None = None
    error: str | None = None
    baseline: str | None = None  # "fsdp": compiled beside the top plans as their baseline
    # XLA's GPU scheduling limit for this program, peak terms (`scheduler_limit_bytes`)
    scheduler_limit_bytes: float | None = None

    @property
    def over_scheduler_limit(self) -> bool:
        """The compiled peak is above the memory XLA's GPU scheduler plans within: it kept the
        program in memory by serialising collectives it would have overlapped."""
        return (self.scheduler_limit_bytes is not None and self.compiled_peak_memory_bytes
                is not None and self.compiled_peak_memory_bytes > self.scheduler_limit_bytes)

    @property
    def fits(self) -> bool:
        """The compiled program's peak fits one device's memory (a failed compile never fits)."""
        return self.error is None and self.compiled_peak_memory_bytes is not None and \
            self.compiled_peak_memory_bytes <= self.device_memory_bytes

    def to_json(self) -> dict:
        c = self.candidate
        return {"label": c.summary(), "rank": self.rank, "mesh": c.layout.mesh(),
                "rules": c.layout.rules(), "microbatches": c.layout.microbatches,
                "predicted_step_s": c.cost.step_s,
                "predicted_peak_memory_bytes": c.cost.peak_memory_bytes,
                "compiled_peak_memory_bytes": self.compiled_peak_memory_bytes,
                "simulated_step_s": self.simulated_step_s, "xla_step_s": self.xla_step_s,
                "gemm_overlap_share": self.gemm_overlap_share, "fits": self.fits,
                "compile_s": self.compile_s, "error": self.error, "baseline": self.baseline,
                "scheduler_limit_bytes": self.scheduler_limit_bytes,
                "over_scheduler_limit": self.over_scheduler_limit}


def scheduler_limit_bytes(memory: dict, device_memory: float) -> float:
    """XLA's GPU scheduling memory limit in the terms of a compiled peak: its non-aliased inputs
    and outputs io, plus the temporary memory XLA schedules within, (0.8 M - io) x 0.95
    (`planner.cost.prices.XLA_SCHEDULER_SHARE`)."""
    io = memory.get("argument", 0) + memory.get("output", 0) - memory.get("alias", 0)
    return io + (0.8 * device_memory - io) * 0.95


def compile_target(cluster: ClusterSpec) -> str:
    """The compile target of a cluster: `local` for CPU clusters (that many local CPU devices),
    `GPU:N` for a GPU XLA compiles for without one (h100, h200, a100, 3090). A cluster JSON's own
    device compiles as the CPU or GPU its `match` names (e.g. an H100 with less memory free)."""
    spec, n = cluster.device_spec, cluster.n_devices
    if spec.name == "cpu" or "cpu" in (m.lower() for m in spec.match):
        return "local"
    gpu = next((g for g in compile_targets() if any(
        m.lower() in COMPILE_FACTS[g]["description"].lower() for m in spec.match)), None)
    if gpu is None:
        raise UserError(
            f"--verify: cluster {cluster.name!r} ({n} x {spec.name}) has no compile target: "
            f"programs compile for local CPU devices (cpu-N) or, without a GPU, for "
            f"{', '.join(compile_targets())} GPUs; verify on such a cluster (e.g. --cluster "
            f"h100:{n}), or drop --verify")
    return f"{gpu}:{n}"


def target_for(cluster: ClusterSpec) -> Target:
    """The compile target of `cluster` (`compile_target`), simulated on the cluster itself (its
    links and device numbers, as the planner priced it)."""
    name = compile_target(cluster)
    target = get_target(name)
    if name == "local":
        devices = target.devices
        if devices[0].platform != "cpu" or len(devices) != cluster.n_devices:
            raise UserError(
                f"--verify on {cluster.name!r} compiles for {cluster.n_devices} local CPU "
                f"devices, but there are {len(devices)} {devices[0].platform} devices; run with "
                f"JAX_PLATFORMS=cpu and --cpu-devices {cluster.n_devices}")
    return dataclasses.replace(target, cluster=cluster)


def candidate_spec(c: Candidate, cfg: ModelConfig):
    """The CompileSpec of a candidate: the train step its plan JSON describes, so the program
    verified is the one `train.py --plan` and `inspect_hlo.py --plan` build."""
    return plans.from_json(plans.candidate_plan(c), "candidate").compile_spec(cfg)


def verify_one(c: Candidate, rank: int, cfg: ModelConfig, target: Target) -> Verified:
    """Compile one candidate for `target` and read its figures. Schedules XLA may abort on
    (`tools.inspection.may_abort`) compile in a child process, simulated on the target's
    built-in cluster. A compile that fails is recorded as the candidate's `error`: it never fits."""
    from oases_jax.tools.inspection import inspect_isolated, inspect_program, may_abort

    spec = candidate_spec(c, cfg)
    memory = target.cluster.memory_per_device
    if target.is_gpu_aot and may_abort(spec):
        r = inspect_isolated(spec, target.name)
    else:
        try:
            r = inspect_program(spec, target).report()
        except Exception as e:  # a plan the runtime cannot build is a finding, not the end
            first = (str(e).strip().splitlines() or [""])[0]
            r = {"error": f"compile failed: {type(e).__name__}: {first}"[:300]}
    jax.clear_caches()  # a 48-layer program's executables are large; keep one at a time
    if "error" in r:
        return Verified(candidate=c, rank=rank, device_memory_bytes=memory, error=r["error"])
    xla = r.get("xla_estimate")
    limit = scheduler_limit_bytes(r.get("memory") or {}, memory) if target.is_gpu_aot else None
    return Verified(candidate=c, rank=rank, device_memory_bytes=memory,
                    scheduler_limit_bytes=limit,
                    compiled_peak_memory_bytes=r["peak_memory_bytes"],
                    simulated_step_s=r["simulated_step_s"],
                    xla_step_s=xla["step_s"] if xla else None,
                    gemm_overlap_share=r["gemm_overlap_share"], compile_s=r["compile_s"])


def fsdp_baseline(result: SearchResult) -> tuple[int, Candidate] | None:
    """(rank, candidate) of the fastest predicted plan that only shards parameters and batch
    over every device (FSDP, no tensor axis): what a user gets from plain FSDP, as MaxText
    runs by default. None when the search has no such layout."""
    for rank, c in enumerate(result.ranked, 1):
        lay = c.layout
        if lay.tensor == 1 and lay.fsdp > 1 and lay.data == 1 and not lay.primepar:
            return rank, c
    return None


def verify(result: SearchResult, cfg: ModelConfig, cluster: ClusterSpec, n: int,
           log: Callable[[str], None] | None = None, baseline: bool = True) -> list[Verified]:
    """Compile the top `n` plans of `result` (by predicted step) for the cluster's target, and
    the best FSDP-only plan beside them when it is not among them (`fsdp_baseline`); it can be
    chosen like any other."""
    if n < 0:
        raise UserError(f"--verify {n} must be >= 0 (0: no verification)")
    target = target_for(cluster)
    todo = [(i, c, None) for i, c in enumerate(result.ranked[:n], 1)]
    base = fsdp_baseline(result) if baseline else None
    if base is not None and base[0] > n:
        todo.append((*base, "fsdp"))
    out = []
    for k, (rank, c, baseline) in enumerate(todo, 1):
        if log:
            what = " (the FSDP-only baseline)" if baseline else ""
            log(f"verifying {k}/{len(todo)} on {target.name}: {c.summary()}{what}")
        out.append(dataclasses.replace(verify_one(c, rank, cfg, target), baseline=baseline))
    return out


def choose(verified: list[Verified]) -> Verified | None:
    """The verified plan that fits with the fastest simulated step; None when none fits."""
    fits = [v for v in verified if v.fits]
    return min(fits, key=lambda v: v.simulated_step_s, default=None)


def no_fit_error(verified: list[Verified], cluster: ClusterSpec) -> UserError:
    """The one-line error when none of the verified plans fits, naming the fixes."""
    n, mem = len(verified), cluster.memory_per_device
    compiled = [v for v in verified if v.compiled_peak_memory_bytes is not None]
    least = min(compiled, key=lambda v: v.compiled_peak_memory_bytes, default=None)
    why = (f"the leanest compiled ({least.candidate.summary()}) peaks at "
           f"{least.compiled_peak_memory_bytes / 2**30:.1f} GiB" if least
           else "every compile failed")
    return UserError(
        f"none of the top {n} plans fits {mem / 2**30:.1f} GiB per device on {cluster.name} when "
        f"compiled ({why}); verify more plans (--verify {2 * n}), or plan a smaller "
        f"--global-batch or another --cluster")


def verified_json(verified: list[Verified], chosen: Verified | None, target: str) -> dict:
    """The plan's `verified` block."""
    return {"target": target, "chosen_by": CHOSEN_BY,
            "device_memory_bytes": verified[0].device_memory_bytes if verified else None,
            "chosen": chosen.rank if chosen else None,
            "candidates": [v.to_json() for v in verified]}


def verify_plan(result: SearchResult, cfg: ModelConfig, cluster: ClusterSpec, n: int, *,
                model: str, cost_source: str, log: Callable[[str], None] = print,
                baseline: bool = True) -> tuple[dict, list[Verified], Verified]:
    """Verify the top `n` plans (and the FSDP-only baseline, unless `baseline` is off), log
    their table, and return the plan JSON of the chosen one (`choose`) with its `verified`
    block; raises `no_fit_error` when none fits."""
    verified = verify(result, cfg, cluster, n, log, baseline)
    chosen = choose(verified)
    target = compile_target(cluster)
    log(f"compiled for {target} (device memory {cluster.memory_per_device / 2**30:.1f} "
        f"GiB); chosen: the fastest plan that fits, by our simulated step")
    log(table(verified, chosen))
    if chosen is None:
        raise no_fit_error(verified, cluster)
    plan = plans.plan_json(result, model=model, cfg=cfg, cluster=cluster.name,
                           cost_source=cost_source, best=chosen.candidate)
    plan["verified"] = verified_json(verified, chosen, target)
    return plan, verified, chosen


def table(verified: list[Verified], chosen: Verified | None) -> str:
    """Each verified plan's prediction beside its compiled figures."""
    def ms(s):
        return f"{s * 1e3:9.2f}" if s is not None else f"{'-':>9}"

    def gib(b):
        return f"{b / 2**30:9.2f}" if b is not None else f"{'-':>9}"

    rows = [f"{'#':>3}  {'plan':<52} {'pred ms':>9} {'pred GiB':>9} {'peak GiB':>9} "
            f"{'sim ms':>9} {'XLA ms':>9} {'GEMM sh':>7}  fits"]
    for v in verified:
        share = f"{v.gemm_overlap_share:7.2f}" if v.gemm_overlap_share is not None else f"{'-':>7}"
        fits = ("yes*" if v.over_scheduler_limit else "yes") if v.fits else (
            "FAILED" if v.error else "NO")
        mark = ("  <- chosen" if v is chosen else "") + ("  (FSDP-only baseline)"
                                                          if v.baseline else "")
        c = v.candidate
        rows.append(f"{v.rank:3d}  {c.summary()[:52]:<52} {ms(c.cost.step_s)} "
                    f"{gib(c.cost.peak_memory_bytes)} {gib(v.compiled_peak_memory_bytes)} "
                    f"{ms(v.simulated_step_s)} {ms(v.xla_step_s)} {share}  {fits}{mark}")
        if v.error:
            rows.append(f"     {v.error}")
    if any(v.over_scheduler_limit for v in verified):
        rows.append("  * above the memory XLA's GPU scheduler plans within "
                    "((0.8 x device memory - inputs/outputs) x 0.95): collectives serialised")
    return "\n".join(rows)


__all__ = ["CHOSEN_BY", "Verified", "candidate_spec", "choose", "compile_target", "fsdp_baseline",
           "no_fit_error", "table", "target_for", "verified_json", "verify", "verify_one",
           "verify_plan"]
