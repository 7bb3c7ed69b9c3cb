"""Orbax checkpoints of the whole training state, written atomically.

Orbax writes each step into a temporary directory and renames it when complete, so a save that
is interrupted leaves the previous checkpoints untouched; unfinished directories are ignored.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import orbax.checkpoint as ocp

from oases_jax.errors import UserError

# Orbax logs every save at INFO; keep the console to the progress bar.
logging.getLogger("absl").setLevel(logging.WARNING)


class _NeverRetrieved(logging.Filter):
    """Drops asyncio's "Task/Future exception was never retrieved" (see Checkpointer._reading)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in record.getMessage()


_NEVER_RETRIEVED = _NeverRetrieved()


def _mute(unraisable) -> None:
    """An unraisablehook that drops everything (see Checkpointer._reading)."""


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
        self.manager = ocp.CheckpointManager(
            path,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=create),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start an (asynchronous) save; the previous save is finished first."""
        self.manager.wait_until_finished()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(self.encode(state)), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def read_meta(self, step: int) -> dict:
        with self._reading(step):
            restored = self.manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        return restored["meta"]

    def restore(self, step: int, abstract_state: Any) -> Any:
        """Restore `step` onto the shardings carried by `abstract_state` (ShapeDtypeStructs)."""
        with self._reading(step):
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        return self.decode(restored["state"])

    @contextlib.contextmanager
    def _reading(self, step: int):
        """Any failure becomes one UserError naming the step (orbax raises many types for
        damaged files).

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
            raise self._corrupt(step, e) from None
        sys.unraisablehook = hook
        asyncio_log.removeFilter(_NEVER_RETRIEVED)

    def _corrupt(self, step: int, e: Exception) -> UserError:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        reason = reason.split(" See full TensorStore details")[0][:160].rstrip(". ")
        return UserError(
            f"checkpoint step {step} in {self.path} is unreadable ({reason}); remove "
            f"{self.path / str(step)} to resume from the previous step, or use a new --ckpt-dir"
        )

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
