"""Measured train-step times on the local devices for several (mesh, rules, schedule) variants,
timed round-robin in one process so that every variant sees the same machine state."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time
from collections.abc import Callable

import jax
from flax import nnx

from oases_jax.errors import UserError
from oases_jax.mesh import make_mesh, parse_mesh
from oases_jax.models.config import ModelConfig
from oases_jax.models.sharding import init_sharded
from oases_jax.pipeline import registry as pipelines
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.rules import get_rules
from oases_jax.tools.op_times import for_variant, kept_dir
from oases_jax.training.config import OptimConfig, ParallelConfig
from oases_jax.training.data import BatchSampler, load_corpus
from oases_jax.training.metrics import peak_flops_per_device, throughput
from oases_jax.training.optim import make_optimizer
from oases_jax.training.program import CompileSpec, lower
from oases_jax.training.state import TrainState, new_state


@dataclasses.dataclass(frozen=True, kw_only=True)
class VariantSpec:
    """One way to run the same train step: `[LABEL:]MESH[/RULES[/SCHEDULE]]` on the command line,
    or one of bench.py's `--pipeline` schedules (over the mesh's `stage` axis)."""

    mesh: str
    rules: str = "tp"
    schedule: str = "megatron"
    label: str | None = None  # None: derived from what differs between the variants
    pipeline: PipelineConfig | None = None  # over the mesh's stage axis; None: none
    # A plan's variant (bench.py --plan): its whole parallel config, micro-batch count and
    # predicted step; None: built from the fields above.
    parallel: ParallelConfig | None = None
    microbatches: int | None = None
    predicted_s: float | None = None


def parse_variant(text: str, *, rules: str = "tp", schedule: str = "megatron") -> VariantSpec:
    """Parse `[LABEL:]MESH[/RULES[/SCHEDULE]]`; a missing or empty RULES or SCHEDULE takes the
    given default. Only the syntax is checked here; `resolve_variants` checks the values."""
    label, sep, body = text.rpartition(":")
    if sep and not label.strip():
        raise UserError(f"variant {text!r} has an empty label before ':'; e.g. "
                        "base:data=2,tensor=4")
    parts = [p.strip() for p in body.split("/")]
    if len(parts) > 3 or not parts[0]:
        raise UserError(f"variant {text!r} is not [LABEL:]MESH[/RULES[/SCHEDULE]]; "
                        "e.g. data=2,tensor=4/tp/megatron")
    parts += [""] * (3 - len(parts))
    return VariantSpec(mesh=parts[0], rules=parts[1] or rules, schedule=parts[2] or schedule,
                       label=label.strip() if sep else None)


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    model: ModelConfig
    model_name: str = "custom"  # for the report only
    variants: tuple[VariantSpec, ...]
    batch_size: int = 16
    seq_len: int = 128
    warmup: int = 3  # untimed steps per variant after compiling
    rounds: int = 10
    steps_per_round: int = 2  # steps of each variant per round, each timed on its own
    seed: int = 0
    data: str = "stdlib"
    # Every variant's batch is split into this many micro-batches (pipelined variants run them
    # through the stages; the others accumulate gradients over them).
    microbatches: int = 1
    op_times: int = 0  # steps profiled per variant after timing (`tools.op_times`); 0: none
    trace_dir: str | None = None  # keep each variant's op_times trace under DIR/LABEL

    def __post_init__(self):
        if not self.variants:
            raise UserError("no variants to time; give at least one --variant or --schedules")
        for name in ("batch_size", "seq_len", "rounds", "steps_per_round", "microbatches"):
            if getattr(self, name) <= 0:
                flag = name.replace("_", "-")
                raise UserError(f"--{flag} {getattr(self, name)} must be positive")
        if self.warmup < 0 or self.op_times < 0:
            flag, value = ("--warmup", self.warmup) if self.warmup < 0 else ("--op-times",
                                                                           self.op_times)
            raise UserError(f"{flag} {value} must be >= 0")
        if self.batch_size % self.microbatches:
            raise UserError(f"--batch-size {self.batch_size} does not split into --microbatches "
                            f"{self.microbatches}; use a multiple of {self.microbatches}")
        for v in self.variants:
            if v.microbatches and self.batch_size % v.microbatches:
                raise UserError(f"--batch-size {self.batch_size} does not split into "
                                f"{v.microbatches} micro-batches (variant {v.label}); use a "
                                f"multiple of {v.microbatches}")
        if self.seq_len > self.model.max_seq_len:
            raise UserError(
                f"--seq-len {self.seq_len} exceeds the model's max_seq_len "
                f"{self.model.max_seq_len}; shorten it or raise max_seq_len"
            )

    @property
    def total_steps(self) -> int:
        return self.warmup + self.rounds * self.steps_per_round + self.op_times

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class Resolved:
    """A variant checked against the devices: resolved mesh, rule set in use, final label."""

    label: str
    mesh: str  # every size filled in
    rules: str  # the rule set actually used (a sequence-parallel schedule upgrades tp to tp_sp)
    schedule: str
    source: VariantSpec  # what it was resolved from (its pipeline, a plan's config, ride here)

    @property
    def pipeline(self) -> str | None:
        """The pipeline schedule's name; None: no pipeline."""
        return self.source.pipeline.schedule if self.source.pipeline else None

    def microbatches(self, cfg: BenchConfig) -> int:
        return self.source.microbatches or cfg.microbatches


def _short_mesh(mesh: str) -> str:
    # data=2,tensor=4 -> d2t4 (the initials of KNOWN_AXES are all different).
    return "".join(f"{name[0]}{size}" for name, size in parse_mesh(mesh).axes)


def _labels(specs: list[VariantSpec], meshes: list[str], rules: list[str]) -> list[str]:
    """Given labels are kept; others show the parts that differ (the rule set each runs)."""
    tables = {None: "", True: "fused", False: "unfused"}
    parts = [(_short_mesh(m), r, s.schedule, s.pipeline.schedule if s.pipeline else "",
              tables[s.pipeline.fused_ticks] if s.pipeline else "")
             for s, m, r in zip(specs, meshes, rules, strict=True)]
    differ = [len({p[i] for p in parts}) > 1 for i in range(5)]
    if not any(differ):
        differ = [True] * 3 + [False] * 2
    labels, seen = [], {}
    for spec, p in zip(specs, parts, strict=True):
        label = spec.label or "/".join(x for x, d in zip(p, differ, strict=True) if d and x)
        seen[label] = seen.get(label, 0) + 1
        labels.append(label if seen[label] == 1 else f"{label}#{seen[label]}")
    return labels


def parallel_config(spec: VariantSpec) -> ParallelConfig:
    """The variant's parallel config (a plan's own on the variant's mesh)."""
    if spec.parallel is not None:
        return dataclasses.replace(spec.parallel, mesh=spec.mesh)
    return ParallelConfig(mesh=spec.mesh, rules=spec.rules, schedule=spec.schedule,
                          pipeline=spec.pipeline)


def resolve_variants(specs: tuple[VariantSpec, ...], n_devices: int,
                     cfg: BenchConfig | None = None) -> list[Resolved]:
    """Check every variant's schedule, rules and mesh (and with `cfg`, a pipelined variant's
    stages, micro-batches and ratios against the model) before anything is compiled."""
    meshes, rules = [], []
    for spec in specs:
        where = spec.label or "/".join((spec.mesh, spec.rules, spec.schedule)
                                       + ((spec.pipeline.schedule,) if spec.pipeline else ()))
        try:
            parallel = parallel_config(spec)
            get_rules(parallel.rules_name)
            mesh = parse_mesh(spec.mesh).resolve(n_devices)
            meshes.append(str(mesh))
            if parallel.pipeline and cfg is not None:
                from oases_jax.training.pipeline_step import spec_for

                spec_for(cfg.model, parallel, spec.microbatches or cfg.microbatches,
                         dict(mesh.axes).get("stage", 1))
        except UserError as e:
            raise UserError(f"variant {where}: {e}") from None
        rules.append(parallel.rules_name)
    labels = _labels(list(specs), meshes, rules)
    return [
        Resolved(label=lab, mesh=m, rules=r, schedule=s.schedule, source=s)
        for lab, m, r, s in zip(labels, meshes, rules, specs, strict=True)
    ]


@dataclasses.dataclass(eq=False)
class Variant:
    """A compiled variant and its live train state (advanced in place by `run_step`)."""

    spec: Resolved
    step: Callable  # (state, batch) -> (state, metrics), compiled
    state: TrainState
    batches: list[jax.Array]  # batch k for step k, identical values in every variant
    compile_s: float
    steps_done: int = 0
    fused: bool | None = None  # a tick-executor pipeline's table: fused or not

    def run_step(self) -> None:
        batch = self.batches[self.steps_done]
        self.state, metrics = self.step(self.state, batch)
        jax.block_until_ready((self.state, metrics))
        self.steps_done += 1


def build_variant(cfg: BenchConfig, spec: Resolved, sampler: BatchSampler) -> Variant:
    """Initialise the model (same seed in every variant), compile the step, place the batches."""
    mesh = make_mesh(spec.mesh)
    rules = get_rules(spec.rules)
    m = spec.microbatches(cfg)
    t0 = time.perf_counter()
    try:  # the compile path training uses: same lowering, same XLA options
        parallel = parallel_config(dataclasses.replace(spec.source, mesh=spec.mesh,
                                                       rules=spec.rules))
        prog = lower(CompileSpec(model=cfg.model, batch_size=cfg.batch_size, seq_len=cfg.seq_len,
                                 microbatches=m, parallel=parallel),
                     mesh, tx=make_optimizer(OptimConfig(), cfg.total_steps))
        lower_s = time.perf_counter() - t0
        fns = prog.fns
        params = nnx.state(init_sharded(cfg.model, rules, mesh, cfg.seed))
        if spec.pipeline:  # the same initial weights, in the stage layout the step reads
            from oases_jax.training import pipeline_step

            pipe = pipeline_step.spec_for(cfg.model, prog.spec.parallel, m, mesh)
            params = pipeline_step.layout(pipe, fns, rules, mesh)[0](params)
            fused = pipe.fused() if pipelines.get(spec.pipeline).executor == "ticks" else None
        state = new_state(params, fns, cfg.seed)
    except UserError as e:
        raise UserError(f"variant {spec.label}: {e}") from None
    t0 = time.perf_counter()
    step = prog.compile()
    compile_s = lower_s + time.perf_counter() - t0
    batches = [sampler.device_batch(k, fns.batch_sharding, m)
               for k in range(cfg.total_steps)]
    return Variant(spec, step, state, batches, compile_s, fused=fused if spec.pipeline else None)


def prepare(cfg: BenchConfig, log: Callable[[str], None] = lambda _: None) -> list[Variant]:
    """Check every variant, then build and compile them all (every state stays in memory)."""
    resolved = resolve_variants(cfg.variants, jax.device_count(), cfg)
    corpus = load_corpus(cfg.data, vocab_size=cfg.model.vocab_size)
    sampler = BatchSampler(
        tokens=corpus.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed
    )
    variants = []
    for spec in resolved:
        variants.append(build_variant(cfg, spec, sampler))
        log(
            f"compiled {spec.label} ({spec.mesh}, {spec.rules}, {spec.schedule}"
            + (f", pipeline {spec.pipeline}" if spec.pipeline else "") + ") "
            f"in {variants[-1].compile_s:.1f} s"
        )
    return variants


def warm_up(variants: list[Variant], steps: int) -> None:
    for v in variants:
        for _ in range(steps):
            v.run_step()


def time_rounds(variants: list[Variant], rounds: int, steps_per_round: int) -> list[list[float]]:
    """Seconds of each timed step per variant. Round r starts at variant r mod n, so no variant
    always runs first (or right after the same neighbour); each step blocks on its result."""
    samples: list[list[float]] = [[] for _ in variants]
    gc.collect()
    gc.disable()  # a collection inside one step's window would land on whichever variant ran
    try:
        for r in range(rounds):
            for i in range(len(variants)):
                k = (r + i) % len(variants)
                for _ in range(steps_per_round):
                    t0 = time.perf_counter()
                    variants[k].run_step()
                    samples[k].append(time.perf_counter() - t0)
    finally:
        gc.enable()
    return samples


def summarize(cfg: BenchConfig, variants: list[Variant], samples: list[list[float]]) -> dict:
    """The report as plain, JSON-ready data; `ratio` is each median over the first variant's."""
    base = statistics.median(samples[0])
    peak = peak_flops_per_device(cfg.model.dtype, None)
    rows = []
    for v, s in zip(variants, samples, strict=True):
        median = statistics.median(s)
        rate = throughput(cfg.model, tokens=cfg.tokens_per_step, seconds=median,
                          seq_len=cfg.seq_len, n_devices=jax.device_count(), peak=peak)
        rows.append(
            {
                "label": v.spec.label,
                "mesh": v.spec.mesh,
                "rules": v.spec.rules,
                "schedule": v.spec.schedule,
                "pipeline": v.spec.pipeline,
                **({"fused_ticks": v.fused} if v.spec.pipeline else {}),
                "microbatches": v.spec.microbatches(cfg),
                **({"plan_predicted_s": v.spec.source.predicted_s}
                   if v.spec.source.predicted_s is not None else {}),
                "median_s": median,
                "min_s": min(s),
                "max_s": max(s),
                **rate,  # tokens_per_s, tflops_per_device, mfu
                "ratio": median / base,
                "compile_s": v.compile_s,
                "samples": list(s),
            }
        )
    device = jax.devices()[0]
    return {
        "device": device.device_kind,
        "platform": device.platform,
        "n_devices": jax.device_count(),
        "model": cfg.model_name,
        "dtype": cfg.model.dtype,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "microbatches": cfg.microbatches,
        "warmup": cfg.warmup,
        "rounds": cfg.rounds,
        "steps_per_round": cfg.steps_per_round,
        "variants": rows,
    }


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = lambda _: None) -> dict:
    """Compile every variant, warm each up, time them round-robin; return `summarize`'s report."""
    variants = prepare(cfg, log)
    warm_up(variants, cfg.warmup)
    log(f"timing {cfg.rounds} rounds x {cfg.steps_per_round} steps x {len(variants)} variants")
    report = summarize(cfg, variants, time_rounds(variants, cfg.rounds, cfg.steps_per_round))
    if cfg.op_times:
        for v, row in zip(variants, report["variants"], strict=True):
            row["op_times"] = for_variant(v, cfg.op_times, kept_dir(cfg.trace_dir, row["label"]))
    return report


def format_table(report: dict) -> str:
    """An aligned text table of a `run_bench` report (a pipeline column when any variant is
    pipelined)."""
    piped = any(r.get("pipeline") for r in report["variants"])
    head = (
        "variant",
        "mesh",
        "rules",
        "schedule",
        *(("pipeline",) if piped else ()),
        "compile s",
        "median ms",
        "min ms",
        "max ms",
        "tokens/s",
        "MFU",
        "ratio",
    )
    rows = [
        (
            r["label"],
            r["mesh"],
            r["rules"],
            r["schedule"],
            *((r.get("pipeline") or "-",) if piped else ()),
            f"{r['compile_s']:.1f}",
            f"{r['median_s'] * 1e3:.2f}",
            f"{r['min_s'] * 1e3:.2f}",
            f"{r['max_s'] * 1e3:.2f}",
            f"{r['tokens_per_s']:,.0f}",
            "-" if r.get("mfu") is None else f"{r['mfu']:.1%}",
            f"{r['ratio']:.3f}",
        )
        for r in report["variants"]
    ]
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=True)]
    left = 5 if piped else 4  # text columns are left-aligned, numbers right-aligned

    def line(cells):
        return "  ".join(
            c.ljust(w) if i < left else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    n = len(report["variants"][0]["samples"])
    micro = report.get("microbatches", 1)
    title = (
        f"{report['model']} ({report['dtype']}), batch {report['batch_size']} x seq "
        f"{report['seq_len']}" + (f" in {micro} micro-batches" if micro > 1 else "")
        + f", on {report['n_devices']} x {report['device']}; {n} timed steps per variant"
    )
    return "\n".join([title, line(head), line(["-" * w for w in widths]), *map(line, rows)])
