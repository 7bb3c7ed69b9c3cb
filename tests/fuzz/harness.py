"""Run one hostile input through a script's `main()` (or a loader) and classify what happened.

A case is an input plus what a correct program does with it: `accept` (a valid input), `reject`
(one-line UserError or exit 2, naming `needle`), or `either` (valid or not depends on something
the case does not pin down). The heavy work after validation (training, searching, compiling,
measuring) is replaced by a stub that raises `Reached`: getting there means the input was
accepted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import signal
import sys
import time
from collections.abc import Callable

from oases_jax.errors import UserError

HANG_S = 5.0  # a case still running after this long has hung (a FIFO, /dev/zero)


class Reached(Exception):
    """The stub of the heavy work was called: validation accepted the input."""


class Hang(BaseException):
    """Raised by the alarm of a case that ran past HANG_S."""


def reached(*_args, **_kwargs):
    raise Reached


@dataclasses.dataclass(frozen=True)
class Case:
    category: str
    name: str
    run: Callable[[], object]  # performs the case; returns, raises or exits
    expect: str = "reject"  # "reject", "accept" or "either"
    needle: str | None = None  # what a rejection must name (a field path, a flag, a value)


@dataclasses.dataclass(frozen=True)
class Result:
    outcome: str  # "accept", "reject", "multiline", "hang", "exit N", "traceback: Type"
    message: str
    seconds: float

    def failure(self, case: Case) -> str | None:
        """Why this result is wrong for `case`, or None."""
        if self.outcome not in ("accept", "reject"):
            return self.outcome
        if case.expect == "reject" and self.outcome == "accept":
            return "silently accepted"
        if case.expect == "accept" and self.outcome == "reject":
            return f"valid input refused: {self.message}"
        if (self.outcome == "reject" and case.needle is not None
                and case.needle.lower() not in self.message.lower()):
            return f"does not name {case.needle!r}: {self.message}"
        return None


def _alarm(_signum, _frame):
    raise Hang


def run(case: Case) -> Result:
    """Run a case with stdout and stderr captured, under an alarm of HANG_S seconds."""
    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, HANG_S)
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            case.run()
        outcome, message = "accept", ""
    except Reached:
        outcome, message = "accept", ""
    except UserError as e:
        message = str(e)
        outcome = "reject" if "\n" not in message.strip() else "multiline"
    except SystemExit as e:
        message = err.getvalue().strip()
        if e.code in (0, None):
            outcome = "accept"
        elif e.code == 2:
            outcome = "reject" if message and "\n" not in message else "multiline"
        else:
            outcome = f"exit {e.code}"
    except Hang:
        outcome, message = "hang", ""
    except BaseException as e:  # noqa: BLE001 - every other exception is the finding
        outcome, message = f"traceback: {type(e).__name__}", str(e)[:200]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return Result(outcome, message, time.perf_counter() - t0)


@contextlib.contextmanager
def argv(*args: str):
    """sys.argv set to `args` for a script's `parse_args()`."""
    old = sys.argv
    sys.argv = list(args)
    try:
        yield
    finally:
        sys.argv = old


def tally(cases: list[Case], results: list[Result]) -> dict[str, tuple[int, int]]:
    """Category -> (failures, cases)."""
    out: dict[str, list[int]] = {}
    for case, result in zip(cases, results, strict=True):
        row = out.setdefault(case.category, [0, 0])
        row[0] += result.failure(case) is not None
        row[1] += 1
    return {k: (v[0], v[1]) for k, v in sorted(out.items())}
