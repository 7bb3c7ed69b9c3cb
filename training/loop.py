"""The training loop: build everything from a TrainConfig, run, log, evaluate, checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import signal
import sys
import time

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from tqdm import tqdm

from oases_jax.errors import UserError
from oases_jax.mesh import make_mesh
from oases_jax.models.layout import layout_fns
from oases_jax.models.sharding import init_sharded
from oases_jax.rules import get_rules
from oases_jax.training import pipeline_step
from oases_jax.training.checkpoint import Checkpointer, NoIntactCheckpoint
from oases_jax.training.config import DivergenceConfig, TrainConfig
from oases_jax.training.data import BatchSampler, load_corpus
from oases_jax.training.integrity import CheckpointDamaged
from oases_jax.training.metrics import MetricsWriter, peak_flops_per_device, throughput
from oases_jax.training.optim import lr_schedule, make_optimizer
from oases_jax.training.program import CompileSpec, StepProgram, lower, schedule_profile_options
from oases_jax.training.runlock import RunLock
from oases_jax.training.state import new_state


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite, spiked, or the gradient norm passed its bound; the
    checkpoints holding the weights that produced it were set aside, the last good one kept."""


class _Guard:
    """Divergence, judged on each step's loss and gradient norm before its checkpoint: NaN or
    infinity, a loss over `loss_spike` times the median of the last `spike_window` losses, or
    a gradient norm over `grad_norm_limit`."""

    MIN_HISTORY = 8  # losses seen before a spike is judged

    def __init__(self, cfg: DivergenceConfig):
        self.cfg = cfg
        self.history: list[float] = []

    def verdict(self, loss: float, grad_norm: float) -> str | None:
        """Why this step diverged, in words, or None (and the loss joins the history)."""
        cfg = self.cfg
        if not math.isfinite(loss):
            return f"loss became {loss}"
        if not math.isfinite(grad_norm):
            return f"gradient norm became {grad_norm}"
        if cfg.grad_norm_limit is not None and grad_norm > cfg.grad_norm_limit:
            return f"gradient norm {grad_norm:.4g} passed --grad-norm-limit {cfg.grad_norm_limit:g}"
        if cfg.loss_spike and len(self.history) >= self.MIN_HISTORY:
            median = float(np.median(self.history))
            if median > 0 and loss > cfg.loss_spike * median:
                return (f"loss {loss:.4g} spiked past --loss-spike {cfg.loss_spike:g} x the median "
                        f"{median:.4g} of the last {len(self.history)} steps")
        self.history = (self.history + [loss])[-cfg.spike_window:]
        return None


@dataclasses.dataclass
class TrainResult:
    losses: dict[int, float]  # optimizer step (1-based) -> training loss of that step
    val_losses: dict[int, float]
    final_step: int
    stopped: str  # "done", "stop_after" or "signal"


def _scalar(x: jax.Array) -> float:
    # Replicated scalars: read this process's copy (works when not fully addressable).
    return float(np.asarray(x.addressable_data(0)))


def _meta(cfg: TrainConfig, step: int) -> dict:
    return {
        "step": step,
        "data_step": step,  # batches are a pure function of (seed, step)
        "model": dataclasses.asdict(cfg.model),
        "seed": cfg.seed,
        "steps": cfg.steps,
        "batch_size": cfg.batch_size,
        "seq_len": cfg.seq_len,
        "data": cfg.data,
    }


# Model fields that change how a step runs, not what it computes: a run may resume with others.
RUNTIME_FIELDS = ("remat", "scan_layers", "dtype", "attention")


def _check_resumable(meta: dict, cfg: TrainConfig) -> None:
    saved = {k: v for k, v in meta["model"].items() if k not in RUNTIME_FIELDS}
    wanted = {k: v for k, v in dataclasses.asdict(cfg.model).items() if k in saved}
    if saved != wanted:
        diff = sorted(k for k in saved if saved[k] != wanted.get(k))
        raise UserError(
            f"checkpoint was written for another model (differs in {', '.join(diff)}); pass the "
            f"same --model and overrides, or use a new --ckpt-dir"
        )
    for key in ("seed", "batch_size", "seq_len", "data"):
        if meta[key] != getattr(cfg, key):
            raise UserError(
                f"checkpoint has {key}={meta[key]!r} but this run has {getattr(cfg, key)!r}; "
                "resume with the same value for an exact continuation"
            )


class _StopSignal:
    """SIGTERM/SIGINT finish the current step, checkpoint, and end the run."""

    def __init__(self):
        self.received = False
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        self.received = True

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def train(cfg: TrainConfig, devices: list[jax.Device] | None = None) -> TrainResult:
    """Train as `cfg` says, on `devices` (default: all devices of all processes)."""
    mesh = make_mesh(cfg.parallel.mesh, devices)
    rules = get_rules(cfg.parallel.rules_name)
    program = step_program(cfg, mesh)  # checks the shapes against the mesh first
    fns = program.fns
    corpus = load_corpus(cfg.data, vocab_size=cfg.model.vocab_size)
    train_batches = BatchSampler(
        tokens=corpus.train, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed
    )
    val_batches = BatchSampler(
        tokens=corpus.val, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed, stream=1
    )
    # Checkpoints hold the standard layout whatever the schedule stores (primepar: permuted).
    to_stored, to_standard = layout_fns(cfg.parallel.schedule, rules, mesh)
    restore_as = fns.abstract_state
    if cfg.parallel.pipeline:  # stage layout in the step, standard in checkpoints
        pipe = pipeline_step.spec_for(cfg.model, cfg.parallel, cfg.microbatches, mesh)
        weights_in, weights_out = to_stored, to_standard  # primepar's block permutation
        to_stages, from_stages, restore_as = pipeline_step.layout(pipe, fns, rules, mesh)
        to_stored = lambda tree: to_stages(weights_in(tree))  # noqa: E731
        to_standard = lambda tree: weights_out(from_stages(tree))  # noqa: E731
    with _output_lock(cfg):  # before anything is written or read there
        ckpt = (
            Checkpointer(cfg.ckpt.dir, keep=cfg.ckpt.keep, create=not cfg.ckpt.resume,
                         encode=to_standard, decode=to_stored)
            if cfg.ckpt.dir
            else None
        )
        try:
            state = _resumed_state(cfg, ckpt, restore_as)
            if state is None:
                model = init_sharded(cfg.model, rules, mesh, cfg.seed)
                state = new_state(to_stored(nnx.state(model)), fns, cfg.seed)
            # With the XLA options its schedules need here (and the scheduling profile asked for).
            extra = schedule_profile_options(cfg.schedule_profile)
            step_fn = program.compile(extra)
            options = {**program.options, **extra}
            if jax.process_index() == 0 and cfg.progress and options:
                print("XLA options: " + " ".join(f"{k}={v}" for k, v in sorted(options.items())))
            with _StopSignal() as stop:  # held through the last save's close
                try:
                    return _run(cfg, state, fns, step_fn, train_batches, val_batches, ckpt,
                                corpus.describe(), stop)
                finally:
                    if ckpt is not None:
                        ckpt.close()
        finally:
            if ckpt is not None:
                ckpt.close()  # if the loop never started (closing twice does nothing)


def _resumed_state(cfg: TrainConfig, ckpt: Checkpointer | None, restore_as):
    """The state of the latest checkpoint under --resume, else None (a fresh run, refused if
    the directory already holds checkpoints)."""
    if ckpt is None:
        return None
    latest = ckpt.latest_step()
    if cfg.ckpt.resume:
        if latest is None:
            raise UserError(
                f"--resume found no checkpoint in {cfg.ckpt.dir}; drop --resume to start fresh"
            )
        return _newest_intact(cfg, ckpt, restore_as)
    if latest is not None:
        raise UserError(
            f"--ckpt-dir {cfg.ckpt.dir} already holds checkpoints (latest step {latest}); pass "
            "--resume to continue, or choose an empty directory"
        )
    return None


def _newest_intact(cfg: TrainConfig, ckpt: Checkpointer, restore_as):
    """The state of the newest checkpoint whose files, metadata and arrays match their digests.
    A damaged one is set aside (renamed `STEP.damaged`, nothing deleted) with one line, and the
    one before it tried; NoIntactCheckpoint if none is left."""
    steps, damaged = ckpt.complete_steps(), []
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        try:
            meta = ckpt.read_meta(step)
            _check_resumable(meta, cfg)
            return ckpt.restore(step, restore_as, meta)
        except CheckpointDamaged as e:
            name = ckpt.set_aside([step], "damaged")[0]
            damaged.append(name)
            then = f"falling back to step {steps[i - 1]}" if i else "no earlier checkpoint"
            if jax.process_index() == 0:
                print(f"checkpoint: step {step} in {ckpt.path} is damaged ({e.reason}); set "
                      f"aside as {name}; {then}", file=sys.stderr, flush=True)
    raise NoIntactCheckpoint(
        f"--resume found no intact checkpoint in {cfg.ckpt.dir}: every one was damaged and set "
        f"aside ({', '.join(damaged)}); start again with a new --ckpt-dir, or rename a set-aside "
        "step back to its number to try it anyway"
    )


@contextlib.contextmanager
def _output_lock(cfg: TrainConfig):
    """Hold the run lock (`training.runlock`) on the checkpoint directory and the metrics file
    for the run's life. Process 0 takes it for all processes and tells them whether it could."""
    if cfg.ckpt.dir and cfg.ckpt.resume and not pathlib.Path(cfg.ckpt.dir).is_dir():
        raise UserError(
            f"--resume found no checkpoint in {cfg.ckpt.dir}; drop --resume to start fresh")
    outputs = [p for p in (cfg.ckpt.dir, cfg.metrics_out) if p]
    lock, refused = RunLock(outputs if jax.process_index() == 0 else []), None
    try:
        lock.__enter__()
    except UserError as e:
        refused = e
    if jax.process_count() > 1 and bool(
            multihost_utils.broadcast_one_to_all(np.int32(refused is not None))):
        refused = refused or UserError(
            "process 0 found this run's outputs in use by another run; wait for it to end or "
            "pass another --out-dir")
    if refused is not None:
        raise refused
    try:
        yield
    finally:
        lock.release()


def step_program(cfg: TrainConfig, mesh: Mesh) -> StepProgram:
    """The train step `train` runs, lowered through the one compile path
    (`training.program`): what `scripts/inspect_hlo.py` reports for the same config."""
    spec = CompileSpec(model=cfg.model, parallel=cfg.parallel, batch_size=cfg.batch_size,
                       seq_len=cfg.seq_len, microbatches=cfg.microbatches)
    return lower(spec, mesh, tx=make_optimizer(cfg.optim, cfg.steps))


def _run(cfg, state, fns, step_fn, train_batches, val_batches, ckpt, corpus_desc, stop
         ) -> TrainResult:
    start = int(_scalar(state["step"]))
    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, start + cfg.stop_after)
    n_dev = fns.batch_sharding.mesh.size
    if jax.process_index() == 0 and cfg.progress:
        print(
            f"data {corpus_desc}; {n_dev} devices, mesh {cfg.parallel.mesh}, "
            f"rules {cfg.parallel.rules_name}; steps {start}..{end} of {cfg.steps}"
        )
    lr_at = lr_schedule(cfg.optim, cfg.steps)
    peak = peak_flops_per_device(cfg.model.dtype, cfg.peak_tflops)
    writer = MetricsWriter(cfg.metrics_out)
    losses, val_losses = {}, {}
    main = jax.process_index() == 0
    bar = tqdm(
        total=cfg.steps,
        initial=start,
        disable=not (cfg.progress and main),
        desc="train",
        unit="step",
        dynamic_ncols=True,
    )
    last_saved = start
    guard = _Guard(cfg.divergence)
    stopped = "done"
    window_t, window_tokens = None, 0
    step = start
    while step < end:
        batch = train_batches.device_batch(step, fns.batch_sharding, cfg.microbatches)
        state, m = step_fn(state, batch)
        step += 1
        loss = _scalar(m["loss"])
        grad_norm = _scalar(m["grad_norm"])
        why = guard.verdict(loss, grad_norm)
        if why:
            bar.close()
            writer.close()
            raise TrainingDiverged(_diverged(cfg, ckpt, step, why))
        if ckpt:
            ckpt.confirm(step - 1)  # this step's loss came from the weights of step - 1
        losses[step] = loss
        now = time.perf_counter()
        if window_t is None:  # the first step includes compilation: start timing after it
            window_t, window_tokens = now, 0
        else:
            window_tokens += cfg.tokens_per_step
        if step % cfg.log_every == 0 or step == end:
            record = {
                "step": step,
                "loss": loss,
                "lr": float(lr_at(step - 1)),
                "grad_norm": grad_norm,
                # MoE: cross entropy, router losses per MoE layer, dropped-choice fraction
                **{k: _scalar(v) for k, v in m.items() if k not in ("loss", "grad_norm")},
            }
            if window_tokens:
                record |= throughput(
                    cfg.model,
                    tokens=window_tokens,
                    seconds=now - window_t,
                    seq_len=cfg.seq_len,
                    n_devices=n_dev,
                    peak=peak,
                )
                window_t, window_tokens = now, 0
            writer.write(record)
            bar.set_postfix(
                loss=f"{loss:.4f}", tok_s=f"{record.get('tokens_per_s', 0):,.0f}", refresh=False
            )
        if cfg.eval_batches and (step % cfg.eval_every == 0 or step == cfg.steps):
            val = _evaluate(fns, state, val_batches, cfg.eval_batches)
            val_losses[step] = val
            writer.write({"step": step, "val_loss": val})
            bar.write(
                f"step {step}: train loss {loss:.4f}, val loss {val:.4f}"
            ) if main else None
            window_t = time.perf_counter()  # keep evaluation out of the throughput
        bar.update(1)
        if stop.received:
            stopped = "signal"
            break
        if ckpt and (step % cfg.ckpt.every == 0 or step == end):
            ckpt.save(step, state, _meta(cfg, step))
            last_saved = step
    if ckpt and last_saved != step:
        ckpt.save(step, state, _meta(cfg, step))
    if stopped == "done" and end < cfg.steps:
        stopped = "stop_after"
    bar.close()
    writer.close()
    return TrainResult(losses=losses, val_losses=val_losses, final_step=step, stopped=stopped)


def _diverged(cfg: TrainConfig, ckpt: Checkpointer | None, step: int, why: str) -> str:
    """The one line of a divergence at `step`, after setting aside the checkpoints from step - 1
    on: they hold the weights whose loss or gradient was bad (a checkpoint at k holds the
    weights after step k's update, which step k + 1 computes from)."""
    head = f"{why} at step {step}; stopped without saving it"
    fix = "lower --lr or raise --warmup-steps"
    if ckpt is None:
        return f"{head}; {fix}"
    ckpt.finish()
    suspect = [k for k in ckpt.complete_steps() if k >= step - 1]
    aside = ckpt.set_aside(suspect, "diverged") if suspect else []
    moved = (f"; set aside checkpoint(s) {', '.join(aside)}, which hold the weights that "
             "produced it") if aside else ""
    good = ckpt.latest_step()
    kept = (f"last good checkpoint: step {good} in {cfg.ckpt.dir}, where --resume continues"
            if good is not None else "no good checkpoint was written before it")
    return f"{head}{moved}; {kept}; {fix}"


def _evaluate(fns, state, sampler: BatchSampler, n_batches: int) -> float:
    total = 0.0
    for i in range(n_batches):
        batch = sampler.device_batch(i, fns.batch_sharding, 1)
        total += _scalar(fns.eval_loss(state["params"], batch))
    return total / n_batches
