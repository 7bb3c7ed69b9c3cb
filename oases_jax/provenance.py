"""Where a result came from: the commit, versions, command and date every result file records
(`benchmarks/results/README.md`), from one helper every script and benchmark uses."""

from __future__ import annotations

import datetime
import functools
import pathlib
import shlex
import subprocess
import sys
from collections.abc import Sequence

_HERE = pathlib.Path(__file__).resolve().parent


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(_HERE), *args], capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.cache
def commit() -> tuple[str | None, bool]:
    """(HEAD's hash, whether tracked files differ from it) of the checkout this package runs
    from; (None, False) for an installed copy (its files are not tracked by any checkout)."""
    if _git("ls-files", "--error-unmatch", "__init__.py") is None:
        return None, False
    head = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    return head, dirty


def command(argv: Sequence[str] | None = None) -> str:
    """The command line as a user would type it again: `python scripts/NAME.py ...` for a
    script run from the checkout, the entry point's name otherwise."""
    argv = list(sys.argv if argv is None else argv)
    prog = pathlib.Path(argv[0]) if argv else pathlib.Path("python")
    if prog.suffix == ".py":
        try:
            prog = prog.resolve().relative_to(_HERE.parent)
        except ValueError:
            pass
        head = ["python", str(prog)]
    else:
        head = [prog.name]
    return shlex.join([*head, *argv[1:]])


def record(argv: Sequence[str] | None = None) -> dict:
    """{"command", "commit", "dirty", "jax", "jaxlib", "date"} for a result file to carry."""
    import jax
    import jaxlib

    head, dirty = commit()
    return {"command": command(argv), "commit": head, "dirty": dirty,
            "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def header(argv: Sequence[str] | None = None) -> str:
    """The same for the top of a text result: the command on its first line, then
    `# commit ..., jax ..., DATE`."""
    r = record(argv)
    at = r["commit"][:12] if r["commit"] else "unknown (an installed copy)"
    at += " (with local changes)" if r["dirty"] else ""
    return f"{r['command']}\n# commit {at}, jax {r['jax']}, {r['date']}"
