"""The training loop: build everything from a TrainConfig, run, log, evaluate, checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import pathlib
import signal
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
from oases_jax.training.checkpoint import Checkpointer
from oases_jax.training.config import TrainConfig
from oases_jax.training.data import BatchSampler, load_corpus
from oases_jax.training.metrics import MetricsWriter, peak_flops_per_device, throughput
from oases_jax.training.optim import lr_schedule, make_optimizer
from oases_jax.training.program import CompileSpec, StepProgram, lower, schedule_profile_options
from oases_jax.training.runlock import RunLock
from oases_jax.training.state import new_state


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint was kept."""


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
            return _run(cfg, state, fns, step_fn, train_batches, val_batches, ckpt,
                        corpus.describe())
        finally:
            if ckpt is not None:
                ckpt.close()


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
        _check_resumable(ckpt.read_meta(latest), cfg)
        return ckpt.restore(latest, restore_as)
    if latest is not None:
        raise UserError(
            f"--ckpt-dir {cfg.ckpt.dir} already holds checkpoints (latest step {latest}); pass "
            "--resume to continue, or choose an empty directory"
        )
    return None


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


def _run(cfg, state, fns, step_fn, train_batches, val_batches, ckpt, corpus_desc
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
    stopped = "done"
    window_t, window_tokens = None, 0
    with _StopSignal() as stop:
        step = start
        while step < end:
            batch = train_batches.device_batch(step, fns.batch_sharding, cfg.microbatches)
            state, m = step_fn(state, batch)
            step += 1
            loss = _scalar(m["loss"])
            if not math.isfinite(loss):
                bar.close()
                writer.close()
                kept = f"step {last_saved} in {cfg.ckpt.dir}" if ckpt and last_saved else "none"
                raise TrainingDiverged(
                    f"loss became {loss} at step {step}; stopped without saving (last good "
                    f"checkpoint: {kept}); lower --lr or raise --warmup-steps"
                )
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
                    "grad_norm": _scalar(m["grad_norm"]),
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


def _evaluate(fns, state, sampler: BatchSampler, n_batches: int) -> float:
    total = 0.0
    for i in range(n_batches):
        batch = sampler.device_batch(i, fns.batch_sharding, 1)
        total += _scalar(fns.eval_loss(state["params"], batch))
    return total / n_batches
