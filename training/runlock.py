"""One live run per output: a lock file beside each output a run writes (its checkpoint directory,
its metrics file), held for the run's whole life, so two runs never interleave checkpoints or
metrics.

The lock is the kernel's (flock, through the `filelock` library): it ends with the process that
holds it, however that process ends, so a lock file left by a killed run is free to take, and
the run that takes it says so. The file also names its holder (pid, host, start time) for the
message that refuses a second run.
"""

from __future__ import annotations

import datetime
import os
import socket
from pathlib import Path

from filelock import FileLock, Timeout

from oases_jax.errors import UserError


def lock_path(output: str | os.PathLike) -> Path:
    """The lock file of `output`: a hidden file beside it (`runs/a/ckpt` -> `runs/a/.ckpt.lock`)."""
    p = Path(output).absolute()
    return p.parent / f".{p.name}.lock"


class RunLock:
    """Locks for `outputs`, taken together or not at all (a context manager)."""

    def __init__(self, outputs: list[str]):
        self.outputs = [Path(o) for o in outputs]
        self.locks: list[tuple[FileLock, Path]] = []

    def __enter__(self) -> RunLock:
        try:
            for output in self.outputs:
                self._take(output)
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _take(self, output: Path) -> None:
        path = lock_path(output)
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = FileLock(path, timeout=0)
        try:
            lock.acquire()
        except Timeout:
            raise UserError(
                f"{output} is in use by another run ({_holder(path)}); wait for it to end or "
                "pass another --out-dir"
            ) from None
        self.locks.append((lock, path))
        left = _holder(path, default="")
        if left:  # a holder that released would have cleared it: this one died holding it
            print(f"note: took over the lock on {output} left by a run that ended without "
                  f"releasing it ({left})")
        started = datetime.datetime.now().isoformat(timespec="seconds")
        path.write_text(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")

    def release(self) -> None:
        for lock, path in reversed(self.locks):
            path.write_text("")  # released cleanly: nothing stale to report
            lock.release()
        self.locks.clear()


def _holder(path: Path, default: str = "holder unknown") -> str:
    try:
        return path.read_text().strip() or default
    except OSError:
        return default
