"""Training configuration: frozen, keyword-only dataclasses nested by concern."""

from __future__ import annotations

import dataclasses
import math

from oases_jax import registry
from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec
from oases_jax.mesh import parse_mesh
from oases_jax.models.config import ModelConfig
from oases_jax.moe import MoESetup
from oases_jax.moe import schedules as moe_schedules
from oases_jax.pipeline import registry as pipelines
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.primepar import square_size
from oases_jax.rules import RULE_SETS
from oases_jax.schema import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, MAX_TOKENS_PER_STEP

MAX_SEED = 2**32 - 1


def _finite(flag: str, value: float, *, low: float = 0.0, low_ok: bool = False,
            high: float | None = None, high_ok: bool = False) -> None:
    """`value` finite and above `low` (or equal, with `low_ok`), below `high` likewise."""
    ok = math.isfinite(value) and (value >= low if low_ok else value > low)
    if high is not None:
        ok = ok and (value <= high if high_ok else value < high)
    if not ok:
        bound = f"{'>=' if low_ok else '>'} {low:g}"
        if high is not None:
            bound += f" and {'<=' if high_ok else '<'} {high:g}"
        raise UserError(f"{flag} {value} must be finite and {bound}")


def check_seed(seed: int, flag: str = "--seed") -> None:
    """Seeds feed numpy's and JAX's generators, which take 0..2^32-1."""
    if not 0 <= seed <= MAX_SEED:
        raise UserError(f"{flag} {seed} must be in 0..{MAX_SEED}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    """AdamW with linear warmup, cosine decay to `min_lr_ratio * lr`, and global-norm clipping."""

    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    clip_norm: float = 1.0

    def __post_init__(self):
        _finite("--lr", self.lr)
        if self.warmup_steps < 0:
            raise UserError(f"--warmup-steps {self.warmup_steps} must be >= 0")
        _finite("min_lr_ratio", self.min_lr_ratio, low_ok=True, high=1.0, high_ok=True)
        _finite("--weight-decay", self.weight_decay, low_ok=True)
        _finite("b1", self.b1, low_ok=True, high=1.0)
        _finite("b2", self.b2, low_ok=True, high=1.0)
        # A negative max norm flips every update (training runs backwards); 0 zeroes them.
        _finite("--clip-norm", self.clip_norm)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Where things run: the mesh, the rule set, the tensor-parallel schedule and the
    pipeline."""

    mesh: str = "data=2,tensor=4"
    rules: str = "tp"
    schedule: str = "megatron"
    sub_batches: int = 2  # Oases schedules: sub-batches per micro-batch
    # MoE models: how the MoE layers run (`oases_jax.moe.schedules`) and parm_s2's chunk count
    # (0: the cost model's choice).
    moe_schedule: str = "auto"
    moe_chunks: int = 0
    # Per-layer strategies from a plan; None: every layer runs `schedule`.
    layers: tuple[LayerSpec, ...] | None = None
    # Pipeline parallelism over the mesh's `stage` axis (`training.pipeline_step`); None: none.
    pipeline: PipelineConfig | None = None

    def __post_init__(self):
        spec = registry.get(self.schedule)
        if self.rules not in RULE_SETS:
            raise UserError(f"unknown --rules {self.rules!r}; choose one of "
                            f"{', '.join(RULE_SETS)}")
        if self.sub_batches < 1:
            raise UserError(f"--sub-batches {self.sub_batches} must be >= 1")
        _check_moe_flags(self)
        if self.rules == "primepar" and not spec.square:
            raise UserError(f"--rules primepar is the rule set of --schedule primepar, not of "
                            f"--schedule {self.schedule}; drop --rules or pass --schedule primepar")
        if spec.sequence_parallel and self.rules not in ("tp", "tp_sp"):
            raise UserError(
                f"--schedule {self.schedule} is tensor + sequence parallel and cannot use "
                f"--rules {self.rules}; use --rules tp_sp"
            )
        if spec.square:
            _check_square_mesh(self.schedule, self.mesh, self.rules)
        _check_pipeline(self)

    @property
    def default_layer(self) -> LayerSpec:
        """The strategy of every layer when there is no plan (remat comes from the model)."""
        return LayerSpec(schedule=self.schedule, sub_batches=self.sub_batches)

    @property
    def layer_sub_batches(self) -> int:
        """Sub-batches a layer splits its micro-batch into (1 outside the Oases schedules); with
        per-layer strategies, the least common multiple over the layers."""
        layers = self.layers or (self.default_layer,)
        return math.lcm(*(s.spec.layer_sub_batches(s.sub_batches) for s in layers))

    @property
    def moe_setup(self) -> MoESetup:
        """How the MoE layers run, with the alpha-beta model `auto` asks."""
        from oases_jax.moe.cost import choose_for_mesh

        return MoESetup(schedule=self.moe_schedule, chunks=self.moe_chunks,
                        choose=choose_for_mesh)

    @property
    def schedules(self) -> tuple[str, ...]:
        """The schedules the layers run, each once, in layer order."""
        scheds = [s.schedule for s in self.layers] if self.layers else [self.schedule]
        return tuple(dict.fromkeys(scheds))

    @property
    def sequence_parallel(self) -> bool:
        """Some layer shards the residual stream on the sequence."""
        return any(registry.get(s).sequence_parallel for s in self.schedules)

    @property
    def rules_name(self) -> str:
        """The rule set actually used: the schedule's (`ScheduleSpec.rules_for`), e.g. `tp`
        upgraded to `tp_sp` by a sequence-parallel schedule."""
        return registry.get(self.schedule).rules_for(self.rules)


def _check_moe_flags(par: ParallelConfig) -> None:
    """--moe-schedule names a schedule, an explicit one has an expert axis to run on, and
    --moe-chunks is a count."""
    moe_schedules.check(par.moe_schedule)
    if par.moe_chunks < 0 or par.moe_chunks > 64:
        raise UserError(f"--moe-chunks {par.moe_chunks} must be in 0..64 (0: the cost model's "
                        "choice)")
    if par.moe_schedule == "auto" or not moe_schedules.get(par.moe_schedule).needs_expert_axis:
        return
    spec = parse_mesh(par.mesh)
    if spec.size("expert") == 1:
        raise UserError(f"--moe-schedule {par.moe_schedule} needs an expert mesh axis and --mesh "
                        f"{par.mesh} has none; add one (e.g. --mesh data=2,expert=2,tensor=2) or "
                        "use --moe-schedule auto")


def _check_pipeline(par: ParallelConfig) -> None:
    """The pipeline against the mesh and the rest of the parallel config, from the schedule's
    record (`oases_jax.pipeline.registry`); what needs only the record is checked by
    `PipelineConfig`, what needs the model or the micro-batches by `PipelineSpec.of`."""
    mesh = parse_mesh(par.mesh)
    runnable = ", ".join(pipelines.names(runnable=True))
    if par.pipeline is None:
        if mesh.size("stage") != 1:
            raise UserError(f"--mesh {par.mesh} has a stage axis but no --pipeline schedule: pass "
                            f"--pipeline 1f1b (or {runnable}), or drop stage=")
        return
    if not isinstance(par.pipeline, PipelineConfig):
        raise UserError(f"pipeline={par.pipeline!r} is not a PipelineConfig: give e.g. "
                        f"PipelineConfig(schedule='1f1b'), or None for no pipeline")
    pipe = pipelines.runnable(par.pipeline.schedule)
    # stage=1 named in the mesh is a one-stage pipeline: the tick loop, residual pools and
    # stage program with no transfers, to measure the executor against plain accumulation.
    if "stage" not in mesh.names:
        raise UserError(f"--pipeline {pipe.name} needs a stage axis in --mesh (e.g. "
                        f"--mesh data=2,stage=2,tensor=2, or stage=1 for a one-stage "
                        f"pipeline), got --mesh {par.mesh}")
    permuting = pipelines.names(permutes_inside=True)
    if not pipe.runs(par.schedule):
        raise UserError(f"--pipeline {pipe.name} cannot run --schedule {par.schedule} inside "
                        f"its stages (its collective-permutes inside the tick's switch would "
                        f"wait for stages running other branches): use --pipeline "
                        f"{' or '.join(permuting)}, or --schedule "
                        f"{', '.join(pipelines.stage_schedules())}")
    if par.rules == "primepar" and not pipe.permutes_inside:
        raise UserError(f"--pipeline {pipe.name} cannot run --rules primepar inside its stages "
                        f"(the square's collective-permutes inside the tick's switch would wait "
                        f"for stages running other branches): use --pipeline "
                        f"{' or '.join(permuting)}")
    if pipe.equal_stages:
        for flag, value in par.pipeline.per_stage_flags():
            raise UserError(f"--pipeline {pipe.name} runs one program on every stage: "
                            f"equal stages under --remat, one backward; drop {flag} {value}")
    if par.layers is not None:
        if pipe.equal_stages:
            raise UserError(f"--pipeline {pipe.name} runs one program on every stage, so one "
                            f"--schedule for every layer; run a per-layer plan under --pipeline "
                            f"{', '.join(pipelines.names(runnable=True, equal_stages=False))}, "
                            f"or drop --plan")
        bad = sorted({s.schedule for s in par.layers if not pipe.runs(s.schedule)})
        if bad:
            raise UserError(f"--pipeline {pipe.name} cannot run the plan's {', '.join(bad)} "
                            f"layers inside its stages; plan with --schedules "
                            f"{','.join(pipelines.stage_schedules())}, or drop --pipeline")


def _check_square_mesh(schedule: str, mesh: str, rules: str) -> None:
    """A square schedule (primepar) runs on a tp_row x tp_col square, with its own rule set."""
    if rules not in ("tp", "primepar"):
        raise UserError(f"--schedule {schedule} uses its own rule set and cannot use --rules "
                        f"{rules}; drop --rules or pass --rules primepar")
    spec = parse_mesh(mesh)
    if spec.size("tensor") != 1:
        raise UserError(f"--schedule {schedule} splits over tp_row x tp_col, not tensor; use "
                        f"e.g. --mesh data=2,tp_row=2,tp_col=2 instead of {mesh}")
    missing = [a for a in registry.get(schedule).mesh_axes if a not in spec.names]
    if missing:  # without its square it would run as plain data parallelism
        raise UserError(f"--schedule {schedule} needs mesh axes tp_row and tp_col, and --mesh "
                        f"{mesh} has no {missing[0]}; use e.g. --mesh data=2,tp_row=2,tp_col=2")
    if -1 not in (spec.size("tp_row"), spec.size("tp_col")):
        square_size(dict(spec.axes), "tp_row", "tp_col")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    dir: str | None = None
    every: int = 100
    resume: bool = False
    keep: int = 3

    def __post_init__(self):
        if self.resume and not self.dir:
            raise UserError("--resume needs --ckpt-dir DIR naming the checkpoints to resume from")
        if self.every <= 0:
            raise UserError(f"--ckpt-every {self.every} must be positive")
        if self.keep < 1:  # Orbax would delete every checkpoint (0) or fail (negative)
            raise UserError(f"--keep {self.keep} must be >= 1: the checkpoints kept")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DivergenceConfig:
    """When a step counts as diverged (`training.loop._Guard`): always a NaN or infinite loss
    or gradient norm; also a loss over `loss_spike` x the median of the last `spike_window`
    losses (0: off), and a gradient norm over `grad_norm_limit` (None: off)."""

    loss_spike: float = 10.0
    spike_window: int = 32
    grad_norm_limit: float | None = None

    def __post_init__(self):
        if self.loss_spike:
            _finite("--loss-spike", self.loss_spike, low=1.0)
        elif self.loss_spike != 0:
            raise UserError(f"--loss-spike {self.loss_spike} must be 0 (off) or > 1")
        if self.spike_window < 1:
            raise UserError(f"spike_window {self.spike_window} must be >= 1")
        if self.grad_norm_limit is not None:
            _finite("--grad-norm-limit", self.grad_norm_limit)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: ModelConfig
    optim: OptimConfig = OptimConfig()
    parallel: ParallelConfig = ParallelConfig()
    ckpt: CheckpointConfig = CheckpointConfig()
    divergence: DivergenceConfig = DivergenceConfig()
    data: str = "stdlib"
    steps: int = 200
    batch_size: int = 16  # global, per optimizer step
    microbatches: int = 1  # gradient accumulation: batch_size / microbatches rows each
    seq_len: int = 128
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    metrics_out: str | None = None
    stop_after: int | None = None  # end this run after this many steps (checkpointed)
    peak_tflops: float | None = None  # per device, for MFU on devices not in the table
    progress: bool = True
    # A scheduling profile the train step compiles with (`inspect_hlo.py
    # --write-schedule-profile`): XLA's GPU scheduler orders the step by its costs.
    schedule_profile: str | None = None

    def __post_init__(self):
        for name in ("steps", "batch_size", "microbatches", "seq_len", "log_every", "eval_every"):
            if getattr(self, name) <= 0:
                raise UserError(
                    f"--{name.replace('_', '-')} {getattr(self, name)} must be positive"
                )
        if self.eval_batches < 0:
            raise UserError(f"--eval-batches {self.eval_batches} must be >= 0 (0: no evaluation)")
        if self.batch_size > MAX_GLOBAL_BATCH or self.seq_len > MAX_SEQ_LEN:
            raise UserError(f"--batch-size {self.batch_size} x --seq-len {self.seq_len} is past "
                            f"the sanity caps ({MAX_GLOBAL_BATCH:,} sequences of "
                            f"{MAX_SEQ_LEN:,} tokens); check the values")
        if self.tokens_per_step > MAX_TOKENS_PER_STEP:
            raise UserError(f"--batch-size x --seq-len = {self.tokens_per_step:,} tokens per "
                            f"step, more than {MAX_TOKENS_PER_STEP:,} (a sanity cap)")
        if self.stop_after is not None and self.stop_after < 1:
            raise UserError(f"--stop-after {self.stop_after} must be >= 1 (steps of this run)")
        if self.peak_tflops is not None:
            _finite("--peak-tflops", self.peak_tflops)
        check_seed(self.seed)
        if self.batch_size % self.microbatches:
            raise UserError(
                f"--batch-size {self.batch_size} is not divisible by --microbatches "
                f"{self.microbatches}; pick a divisor"
            )
        if self.seq_len > self.model.max_seq_len:
            raise UserError(
                f"--seq-len {self.seq_len} exceeds the model's max_seq_len "
                f"{self.model.max_seq_len}; shorten it or raise max_seq_len"
            )
        stages = parse_mesh(self.parallel.mesh).size("stage")
        pipe = self.parallel.pipeline
        if pipe is not None and pipe.split_head and self.seq_len % stages:
            raise UserError(f"--split-head on splits each micro-batch's {self.seq_len} positions "
                            f"over {stages} stages: use a --seq-len divisible by {stages}, or "
                            f"--split-head off")

    @property
    def micro_batch_size(self) -> int:
        return self.batch_size // self.microbatches

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len
