"""Each script's `main()` in this process, up to the heavy work it validates its input for: the
training loop, the search (only with `search=False`), the compile, the timed steps and the
measurements are stubs that raise `Reached`. The device set-up (`init_runtime`) is skipped: the
test process already has its 8 CPU devices."""

from __future__ import annotations

import contextlib
import importlib
from unittest import mock

from tests.fuzz.harness import Hang, Reached, argv, reached


def _script(name: str):
    return importlib.import_module(f"scripts.{name}")


@contextlib.contextmanager
def _stubs(module, *targets: str):
    with contextlib.ExitStack() as stack:
        if hasattr(module, "init_runtime"):
            stack.enter_context(mock.patch.object(module, "init_runtime", lambda _args: None))
        for target in targets:
            stack.enter_context(mock.patch(target, reached))
        yield


def train(*args: str) -> None:
    module = _script("train")
    with _stubs(module, "oases_jax.training.train"), argv("train.py", "--no-progress", *args):
        module.main()


def inspect_hlo(*args: str) -> None:
    module = _script("inspect_hlo")
    with _stubs(module, "oases_jax.tools.inspection.inspect_program",
                "oases_jax.tools.inspection.inspect_isolated"), \
            argv("inspect_hlo.py", *args):
        module.main()


def plan(*args: str, search: bool = True) -> None:
    """plan.py; with `search`, the search runs (it takes milliseconds on `tiny`)."""
    module = _script("plan")
    targets = () if search else ("oases_jax.planner.make_plan",)
    with _stubs(module, *targets), argv("plan.py", *args):
        module.main()


def bench(*args: str) -> None:
    module = _script("bench")
    with _stubs(module, "oases_jax.tools.bench.run_bench"), argv("bench.py", *args):
        module.main()


def calibrate(*args: str) -> None:
    module = _script("calibrate")
    with (_stubs(module, "oases_jax.planner.calibration.calibrate.calibrate"),
          argv("calibrate.py", *args)):
        module.main()


def memory_table(*args: str) -> None:
    module = _script("memory_table")
    with (_stubs(module, "oases_jax.tools.inspection.inspect_isolated"),
          argv("memory_table.py", *args)):
        module.main()


def both(*runs) -> None:
    """Run every callable; raise the worst of what they raised (another exception before a
    UserError or exit, those before `Reached`), so that one target's clean rejection does not
    hide another's traceback."""
    raised: list[BaseException] = []
    for fn in runs:
        try:
            fn()
        except Reached:
            continue
        except Hang:
            raise
        except BaseException as e:  # noqa: BLE001 - sorted below
            raised.append(e)
    from oases_jax.errors import UserError

    def rank(e: BaseException) -> int:
        return 1 if isinstance(e, UserError | SystemExit) else 0

    if raised:
        raise min(raised, key=rank)
    raise Reached
