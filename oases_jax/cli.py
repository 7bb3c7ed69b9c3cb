"""Command-line plumbing shared by the scripts: one-line errors and device/process set-up."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os
import pathlib
import re
import signal
import sys
import tempfile
from collections.abc import Callable

from oases_jax import multihost
from oases_jax.errors import UserError

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a process SIGINT ended


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line with the fix, not a usage dump."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def run_main(
    main: Callable[[], int | None], *, extra_errors: dict[type, int] | None = None
) -> None:
    """Run `main`; a UserError (or an `extra_errors` type) becomes one line on stderr and an exit
    code, never a traceback. SIGINT ends the run with one line and EXIT_INTERRUPTED, except
    inside a training loop, which installs its own handler (checkpoint, then stop)."""
    codes = {UserError: EXIT_USER_ERROR, **(extra_errors or {})}
    prog = os.path.basename(sys.argv[0])
    previous = _exit_on_sigint(prog)
    try:
        code = main() or 0
    except tuple(codes) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        code = next(code for cls, code in codes.items() if isinstance(e, cls))
    except KeyboardInterrupt:  # a SIGINT that reached Python as an exception after all
        print(_interrupted(prog), file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Exception:
        # In a multi-process run most such errors are a collective failing because another
        # process died: the watch then names it in one line and ends this process.
        multihost.await_verdict()
        multihost.leave(1)
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    multihost.leave(code)  # the other processes of a multi-process run learn how this one ended
    sys.exit(code)


def _interrupted(prog: str) -> str:
    return (f"{prog}: interrupted (SIGINT) before it finished; nothing was written since the last "
            "complete output")


def _exit_on_sigint(prog: str):
    """SIGINT outside a training loop (start-up, a compile, a search, a measurement) exits at
    once with one line: raised as KeyboardInterrupt it would land anywhere, in a compile or in a
    garbage-collection callback that swallows it. Nothing half-written is left: outputs are
    written atomically and checkpoints only by the loop. Returns the handler replaced (None off
    the main thread, where none can be set)."""

    def handler(signum, frame):
        os.write(2, (_interrupted(prog) + "\n").encode())
        os._exit(EXIT_INTERRUPTED)

    try:
        return signal.signal(signal.SIGINT, handler)
    except ValueError:
        return None


def add_runtime_flags(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("devices and processes")
    g.add_argument(
        "--cpu-devices",
        type=int,
        default=8,
        help="virtual CPU devices per process when running on CPU (default 8)",
    )
    g.add_argument("--coordinator", type=host_port,
                   help="multi-host: coordinator address HOST:PORT")
    g.add_argument("--num-processes", type=int, help="multi-host: total number of processes")
    g.add_argument("--process-id", type=int, help="multi-host: this process's index")
    g.add_argument("--join-timeout", type=float, default=300.0,
                   help="multi-host: seconds to wait for every process to join (default 300)")
    g.add_argument("--peer-timeout", type=float, default=60.0,
                   help="multi-host: seconds without a heartbeat after which a process counts "
                   "as lost and the others stop (default 60)")


_HOST = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def host_port(text: str) -> str:
    """`--coordinator`: HOST:PORT (an IPv6 address as [ADDR]:PORT), port 1..65535, checked here
    because jax.distributed crashes the process (a segmentation fault) on anything else."""
    host, sep, port = text.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            host = ""
    elif not _HOST.fullmatch(host):
        host = ""
    if not (sep and host and port.isdigit() and 1 <= int(port) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT with a port in 1..65535; "
                                         "e.g. 10.0.0.1:1234 or [fd00::1]:1234")
    return text


_CLUSTER_ENV = ("JAX_COORDINATOR_ADDRESS", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE")


def init_runtime(args: argparse.Namespace) -> None:
    """Set the CPU device count and join a multi-process job, before JAX touches a backend.

    Multi-host comes from the flags, or else from a cluster environment JAX recognises (SLURM,
    Open MPI, or JAX_COORDINATOR_ADDRESS) when it reports more than one process.
    """
    import jax

    if args.cpu_devices <= 0:
        raise UserError(f"--cpu-devices {args.cpu_devices} must be positive")
    jax.config.update("jax_num_cpu_devices", args.cpu_devices)
    flags = (args.coordinator, args.num_processes, args.process_id)
    if any(f is not None for f in flags):
        if any(f is None for f in flags):
            raise UserError(
                "multi-host needs all of --coordinator, --num-processes and --process-id"
            )
        if not 0 <= args.process_id < args.num_processes:
            raise UserError(
                f"--process-id {args.process_id} is outside 0..{args.num_processes - 1}"
            )
        _join(args, args.coordinator, args.num_processes, args.process_id)
    elif any(
        int(os.environ.get(v, "0") or 0) > 1 if v != "JAX_COORDINATOR_ADDRESS" else v in os.environ
        for v in _CLUSTER_ENV
    ):
        _join(args)


def _join(args: argparse.Namespace, *where) -> None:
    """Join the multi-process run with bounded waits (`oases_jax.multihost`)."""
    for flag in ("join_timeout", "peer_timeout"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"--{flag.replace('_', '-')} {value} must be finite and > 0 "
                            "(seconds)")
    multihost.join(*where, join_timeout=args.join_timeout, peer_timeout=args.peer_timeout)


def write_atomic(path: str, text: str) -> None:
    """Write `text` to `path` through a temporary file and a rename: readers never see a partial
    file, and a failure leaves nothing behind."""
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    umask = os.umask(0)
    os.umask(umask)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600; give the file the usual mode
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise
