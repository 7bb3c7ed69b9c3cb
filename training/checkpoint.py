"""Orbax checkpoints of the whole training state, written atomically.

Orbax writes each step into a temporary directory (`STEP.orbax-checkpoint-tmp`) and renames it
when complete, so a save that is interrupted leaves the previous checkpoints untouched. The
unfinished directory of a killed run is removed when the next run opens the directory (under
the run lock, so no live run is writing it); a save that fails (a full disk) removes its own and
ends the run with one line.

Each save also records digests of every array and of its metadata (`training.integrity`),
checked on restore before a byte is used: a damaged step raises CheckpointDamaged, and
`--resume` sets it aside and falls back to the previous one. Old checkpoints are rotated here,
not by orbax, so that the newest checkpoint known to be good (`confirm`) outlives `keep`
while a newer one is still suspect.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import re
import shutil
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from oases_jax import multihost
from oases_jax.errors import UserError
from oases_jax.training.integrity import (
    ARRAY_DIGESTS,
    CheckpointDamaged,
    array_digests,
    mismatch,
    sealed,
    unreadable_entry,
    unsealed,
)

TMP_SUFFIX = ".orbax-checkpoint-tmp"

# Orbax logs every save at INFO; keep the console to the progress bar.
logging.getLogger("absl").setLevel(logging.WARNING)


class CheckpointWriteError(RuntimeError):
    """A save could not be written (disk full, permissions); its partial files were removed
    and the earlier checkpoints are intact."""


class NoIntactCheckpoint(RuntimeError):
    """`--resume` found checkpoints, and every one was damaged (each set aside, none deleted)."""


class _OrbaxErrors(logging.Filter):
    """Drops orbax's own error logs (a traceback per failed thread): every orbax failure reaches
    the caller as an exception, which the Checkpointer reports in one line."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


logging.getLogger("absl").addFilter(_OrbaxErrors())


class _NeverRetrieved(logging.Filter):
    """Drops asyncio's "Task/Future exception was never retrieved" (see Checkpointer._reading)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in record.getMessage()


_NEVER_RETRIEVED = _NeverRetrieved()
_NEVER_RETRIEVED_AFTER_WRITES = _NeverRetrieved()  # kept when a later read removes the other


class _OrbaxNeverRetrieved(logging.Filter):
    """Drops "exception was never retrieved" for a task that failed inside orbax. A failed
    write's sibling tasks can be collected, and logged, on orbax's thread before the failure
    reaches `Checkpointer._writing`, which reports it in one line; so this filter is always on."""

    def filter(self, record: logging.LogRecord) -> bool:
        if "exception was never retrieved" not in record.getMessage() or not record.exc_info:
            return True
        tb = record.exc_info[2]
        while tb is not None:
            if f"{os.sep}orbax{os.sep}" in tb.tb_frame.f_code.co_filename:
                return False
            tb = tb.tb_next
        return True


logging.getLogger("asyncio").addFilter(_OrbaxNeverRetrieved())


def _mute(unraisable) -> None:
    """An unraisablehook that drops everything (see Checkpointer._reading)."""


def _closed_loop(value) -> bool:
    return isinstance(value, RuntimeError) and str(value) == "Event loop is closed"


def _install_closed_loop_filter() -> None:
    """Drop "Event loop is closed" errors from both of Python's last-resort reporters.

    When a save or read fails, orbax closes its event loop while TensorStore still completes
    the abandoned writes; each completion calls `loop.call_soon_threadsafe` from a TensorStore
    thread, which raises, and TensorStore reports it as unraisable (or prints it), long before
    the failure reaches the Checkpointer: a hundred tracebacks that say nothing the one error
    line does not. Everything else passes through to the hooks that were there.
    """
    if getattr(sys.unraisablehook, "oases_closed_loop_filter", False):
        return
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def unraisable_filtered(u) -> None:
        if not _closed_loop(u.exc_value):
            unraisable(u)

    def excepthook_filtered(kind, value, tb) -> None:
        if not _closed_loop(value):
            excepthook(kind, value, tb)

    unraisable_filtered.oases_closed_loop_filter = True
    sys.unraisablehook, sys.excepthook = unraisable_filtered, excepthook_filtered


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3, create: bool = True,
                 encode: Callable[[Any], Any] | None = None,
                 decode: Callable[[Any], Any] | None = None):
        """`create=False` (resuming) leaves a missing directory missing: a mistyped path is
        reported, not made. `encode` maps a state to what is written (e.g. primepar's stored
        weights to the standard layout) and `decode` maps it back after reading."""
        self.encode, self.decode = encode or (lambda s: s), decode or (lambda s: s)
        path = pathlib.Path(directory).absolute()
        if path.exists() and not path.is_dir():
            raise UserError(f"--ckpt-dir {directory!r} is a file; pass a directory")
        self.path = path
        self.pending: int | None = None  # the step being written in the background
        self.closed = False
        self.keep = keep
        self.good_upto: int | None = None  # checkpoints up to this step trained on cleanly
        self._say_leftovers()
        multihost.on_lost(self.remove_unfinished)  # a lost process abandons the run's save
        _install_closed_loop_filter()
        self.manager = ocp.CheckpointManager(
            path,
            options=ocp.CheckpointManagerOptions(create=create, cleanup_tmp_directories=True),
        )

    def _say_leftovers(self) -> None:
        """One line naming the unfinished saves orbax is about to remove (process 0)."""
        if jax.process_index() != 0 or not self.path.is_dir():
            return
        left = sorted(p.name for p in self.path.iterdir() if TMP_SUFFIX in p.name)
        if left:
            print(f"checkpoint: removing {len(left)} unfinished save(s) of an interrupted run "
                  f"from {self.path}: {', '.join(left)}")

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start an (asynchronous) save; the previous save is finished first. A save that
        fails raises CheckpointWriteError here or at the next save or `close`. The metadata
        gains the digests of the arrays written and its own."""
        stored = self.encode(state)
        meta = sealed({**meta, ARRAY_DIGESTS: array_digests(stored)})
        with self._writing():
            self.manager.wait_until_finished()
            self._rotate()
            self.pending = step
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(stored),
                    meta=ocp.args.JsonSave(meta),
                ),
                force=True,
            )

    def confirm(self, step: int) -> None:
        """The checkpoints up to `step` hold weights a later step trained on cleanly (its loss
        and gradient were sane), so the newest of them is kept by the rotation until a newer
        one is confirmed too."""
        self.good_upto = step if self.good_upto is None else max(self.good_upto, step)

    def last_good(self) -> int | None:
        """The newest complete checkpoint confirmed good (`confirm`), or None."""
        good = [s for s in self.complete_steps()
                if self.good_upto is not None and s <= self.good_upto]
        return good[-1] if good else None

    def _rotate(self) -> None:
        """Delete complete checkpoints beyond the newest `keep`, except the newest confirmed
        one (while the ones after it are unconfirmed). Call with no save in flight."""
        steps, good = self.complete_steps(), self.last_good()
        for step in steps[:-self.keep]:
            if step != good:
                self.manager.delete(step)

    def finish(self) -> None:
        """Wait for the save in flight (CheckpointWriteError if it failed)."""
        with self._writing():
            self.manager.wait_until_finished()

    def set_aside(self, steps: list[int], why: str) -> list[str]:
        """Rename checkpoint steps to `STEP.WHY` (orbax reads only numbered directories, so
        resuming skips them and nothing is deleted); returns the new names. Process 0 renames;
        every process then reloads the step list."""
        self.finish()
        names = []
        for step in steps:
            target = self.path / f"{step}.{why}"
            n = 1
            while target.exists():
                n += 1
                target = self.path / f"{step}.{why}{n}"
            names.append(target.name)
            if jax.process_index() == 0:
                (self.path / str(step)).rename(target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("oases_jax checkpoint set aside")
        self.manager.reload()
        return names

    @contextlib.contextmanager
    def _writing(self):
        """Any failure of a save becomes one CheckpointWriteError line, after the save's
        partial files are removed."""
        try:
            yield
        except Exception as e:
            multihost.await_verdict()  # a barrier failing because a process died: exit 4
            # Orbax's abandoned writes keep reporting the failure as unraisable exceptions and
            # unretrieved futures until the process ends (as for reads, see _reading).
            sys.unraisablehook = _mute
            logging.getLogger("asyncio").addFilter(_NEVER_RETRIEVED_AFTER_WRITES)
            step, self.pending = self.pending, None
            with contextlib.suppress(Exception):  # let orbax's other writes end first
                self.manager.wait_until_finished()
            self.remove_unfinished(settle=1.0)
            complete = self.complete_steps()
            kept = f"step {complete[-1]} is the latest checkpoint" if complete else \
                "no checkpoint was complete"
            raise CheckpointWriteError(
                f"checkpoint step {step} could not be written to {self.path} ({_reason(e)}); "
                f"its partial files were removed and {kept}; free space or pass another "
                "--ckpt-dir, then --resume"
            ) from None

    def remove_unfinished(self, settle: float = 0.0) -> None:
        """Remove unfinished saves (process 0, which finalises saves); also called when the
        run is abandoned (a lost process). `settle`: after a failed save, TensorStore may
        still finish writes orbax gave up waiting for, and each recreates the directories
        above it; return only once none has reappeared for that many seconds (at most 10 s)."""
        if jax.process_index() != 0 or not self.path.is_dir():
            return
        quiet, deadline = 0.0, time.monotonic() + 10.0
        while time.monotonic() < deadline:
            left = [p for p in self.path.iterdir() if TMP_SUFFIX in p.name]
            for p in left:
                shutil.rmtree(p, ignore_errors=True)
            quiet = 0.0 if left else quiet + 0.1
            if not left and quiet > settle:
                return
            time.sleep(0.1)

    def complete_steps(self) -> list[int]:
        """Steps with a complete checkpoint on disk, in order."""
        if not self.path.is_dir():
            return []
        return sorted(int(p.name) for p in self.path.iterdir() if p.name.isdigit())

    def read_meta(self, step: int) -> dict:
        """The metadata of `step`, checked against its digest (the digests stay in it, for
        `restore`); CheckpointDamaged if a file under the step cannot be read safely, the
        metadata is unreadable or does not match its digest."""
        entry = unreadable_entry(self.path / str(step))
        if entry:
            raise CheckpointDamaged(step, entry)
        with self._reading(step):
            restored = self.manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        meta, damage = unsealed(restored["meta"])
        if damage:
            raise CheckpointDamaged(step, damage)
        return meta

    def restore(self, step: int, abstract_state: Any, meta: dict | None = None) -> Any:
        """Restore `step` onto the shardings carried by `abstract_state` (ShapeDtypeStructs),
        its arrays checked against the digests in `meta` (read here if not given) before they
        are decoded: CheckpointDamaged on any difference. A checkpoint written before digests
        existed is restored unchecked."""
        meta = self.read_meta(step) if meta is None else meta
        with self._reading(step):
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        if ARRAY_DIGESTS in meta:
            damage = mismatch(meta[ARRAY_DIGESTS], array_digests(restored["state"]))
            if damage:
                raise CheckpointDamaged(step, damage)
        return self.decode(restored["state"])

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Any failure becomes one CheckpointDamaged naming the step (orbax raises many types
        for damaged files).

        When one read fails, orbax abandons the others and closes its event loop while
        TensorStore still finishes them: until the process ends they report the same damage
        as unraisable exceptions ("Event loop is closed", errors from closed coroutines) and
        "exception was never retrieved" logs, hundreds of tracebacks that add nothing. So both
        channels are muted while a read runs, and stay muted after one fails.
        """
        hook, asyncio_log = sys.unraisablehook, logging.getLogger("asyncio")
        sys.unraisablehook = _mute
        asyncio_log.addFilter(_NEVER_RETRIEVED)
        try:
            yield
        except Exception as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            reason = reason.split(" See full TensorStore details")[0][:160].rstrip(". ")
            raise CheckpointDamaged(step, f"unreadable: {reason}") from None
        sys.unraisablehook = hook
        asyncio_log.removeFilter(_NEVER_RETRIEVED)

    def close(self) -> None:
        """Finish the last save (CheckpointWriteError if it failed) and release orbax; once."""
        if self.closed:
            return
        self.closed = True
        try:
            with self._writing():
                self.manager.wait_until_finished()
                self._rotate()
        finally:
            self.manager.close()


def _reason(e: Exception) -> str:
    """The OS error behind a failed write (orbax wraps TensorStore's), else the first line."""
    text = str(e)
    code = re.search(r"os_error_code='(\d+)'", text)
    if code:
        return os.strerror(int(code.group(1)))
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    return (text.splitlines()[0] if text else type(e).__name__)[:160]
