"""Orbax checkpoints of the whole training state, written atomically.

Orbax writes each step into a temporary directory and renames it when complete, so a save that
is interrupted leaves the previous checkpoints untouched; unfinished directories are ignored.
"""

from __future__ import annotations

import logging
import pathlib
from typing import Any

import orbax.checkpoint as ocp

from oases_jax.errors import UserError

# Orbax logs every save at INFO; keep the console to the progress bar.
logging.getLogger("absl").setLevel(logging.WARNING)


class Checkpointer:
    def __init__(self, directory: str, *, keep: int = 3):
        path = pathlib.Path(directory).absolute()
        if path.exists() and not path.is_dir():
            raise UserError(f"--ckpt-dir {directory!r} is a file; pass a directory")
        self.path = path
        self.manager = ocp.CheckpointManager(
            path,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Start an (asynchronous) save; the previous save is finished first."""
        self.manager.wait_until_finished()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )

    def read_meta(self, step: int) -> dict:
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )
        except Exception as e:  # orbax raises many types for damaged files
            raise self._corrupt(step, e) from None
        return restored["meta"]

    def restore(self, step: int, abstract_state: Any) -> Any:
        """Restore `step` onto the shardings carried by `abstract_state` (ShapeDtypeStructs)."""
        try:
            restored = self.manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
            )
        except Exception as e:
            raise self._corrupt(step, e) from None
        return restored["state"]

    def _corrupt(self, step: int, e: Exception) -> UserError:
        reason = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        return UserError(
            f"checkpoint step {step} in {self.path} is unreadable ({reason}); remove "
            f"{self.path / str(step)} to resume from the previous step, or use a new --ckpt-dir"
        )

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
