"""Multi-process runs that fail cleanly: joining gives up after a bounded wait, and when a process
is lost the others stop within a bounded time, each with one line naming the lost process.

`jax.distributed.initialize` bounds both waits itself (`initialization_timeout`,
`heartbeat_timeout_seconds`), but its reaction to either is a C++ abort: a 60-70 line stack
trace, the lost process never named, and no Python code run (the client's
`missed_heartbeat_callback` cannot be used from Python: in jax 0.12 its binding dies converting
the status, std::bad_cast). So jax's timeouts are kept as backstops a little beyond ours, and
two daemon threads act first: a timer while joining, then a watch that writes this process's
heartbeat counter into jax's coordination key-value store, reads the others', and ends the
process (cleanup hooks, one line on stderr, exit code EXIT_PEER_LOST) when a counter stops
moving for `peer_timeout` seconds, when the store stops answering (the coordinator, process 0,
is gone), or when another process ends with an error while this one still runs.
"""

from __future__ import annotations

import inspect
import math
import os
import sys
import threading
import time
from collections.abc import Callable

EXIT_PEER_LOST = 4
_PREFIX = "oases_jax/multihost/"


def _backstops(join_timeout: float, peer_timeout: float) -> dict:
    """jax.distributed.initialize's own timeouts, set beyond ours (those it accepts: the
    heartbeat setting has had other names in older jax)."""
    import jax

    wanted = {"initialization_timeout": int(math.ceil(join_timeout)) + 30,
              "heartbeat_timeout_seconds": int(math.ceil(2 * peer_timeout)) + 10}
    accepted = inspect.signature(jax.distributed.initialize).parameters
    return {k: v for k, v in wanted.items() if k in accepted}


def _die(message: str | None, code: int) -> None:
    """End the process now: `message` as one line on stderr (none if None), no atexit handlers
    (jax's would wait on the lost process at its shutdown barrier)."""
    if message is not None:
        sys.stderr.write(f"{os.path.basename(sys.argv[0])}: error: {message}\n")
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def join(coordinator: str | None = None, num_processes: int | None = None,
         process_id: int | None = None, *, join_timeout: float, peer_timeout: float) -> None:
    """`jax.distributed.initialize` (arguments None: from the cluster environment), giving up
    with one line and EXIT_PEER_LOST after `join_timeout` seconds; then watch the peers."""
    import jax

    who = f"process {process_id}" if process_id is not None else "this process"

    def give_up():
        _die(f"{who} waited {join_timeout:g} s for all {num_processes or ''} processes to join "
             f"at {coordinator or 'the cluster coordinator'} and gave up; start every process "
             "with the same --coordinator and --num-processes, or raise --join-timeout",
             EXIT_PEER_LOST)

    timer = threading.Timer(join_timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(coordinator, num_processes=num_processes,
                                   process_id=process_id,
                                   **_backstops(join_timeout, peer_timeout))
    finally:
        timer.cancel()
    from jax._src import distributed  # the coordination service client jax itself uses

    client, me = distributed.global_state.client, jax.process_index()
    try:
        client.key_value_set(f"{_PREFIX}beat/{me}", "joined", True)
        client.key_value_dir_get(_PREFIX)
    except (TypeError, AttributeError):  # a client of another shape: jax's backstops only
        return
    global _WATCH
    _WATCH = _Watch(client, me, jax.process_count(), peer_timeout,
                    coordinator or "the cluster coordinator")
    _WATCH.start()


class _Watch:
    """Heartbeat counters in the coordination store, and the verdict when one stops."""

    def __init__(self, client, me: int, n: int, timeout: float, coordinator: str):
        self.client, self.me, self.n, self.timeout = client, me, n, timeout
        self.coordinator = coordinator
        self.interval = min(1.0, timeout / 5)
        now = time.monotonic()
        self.seen = {j: (None, now) for j in range(n) if j != me}  # counter, when it moved
        self.contact = now  # last answer from the store
        self.finished: set[int] = set()  # peers that ended with exit code 0
        self.leaving: int | None = None  # our exit code once our own work is done
        self.hooks: list[Callable[[], None]] = []
        self.verdict = threading.Lock()

    def start(self) -> None:
        for target in (self._beat, self._judge):
            threading.Thread(target=target, daemon=True, name=f"oases-{target.__name__}").start()

    def _beat(self) -> None:
        count = 0
        while True:
            try:
                self.client.key_value_set(f"{_PREFIX}beat/{self.me}", str(count), True)
                values = dict(self.client.key_value_dir_get(_PREFIX))
            except Exception:  # noqa: BLE001 - no answer: _judge times the silence
                time.sleep(self.interval)
                continue
            now = time.monotonic()
            self.contact, count = now, count + 1
            for j, (last, _) in list(self.seen.items()):
                value = values.get(f"{_PREFIX}beat/{j}")
                if value != last:
                    self.seen[j] = (value, now)
                code = values.get(f"{_PREFIX}exit/{j}")
                if code == "0":
                    self.finished.add(j)
                elif code is not None and self.leaving is None:
                    self.lost(f"process {j} of {self.n} ended with exit code {code}, so this "
                              f"run cannot go on; this process stops too (see process {j}'s "
                              "error)")
            time.sleep(self.interval)

    def _judge(self) -> None:
        while True:
            time.sleep(self.interval)
            now = time.monotonic()
            if now - self.contact > self.timeout:
                self.lost(f"lost contact with the coordinator (process 0, {self.coordinator}) "
                          f"for {self.timeout:g} s; it died or its host is unreachable")
            for j, (_, moved) in list(self.seen.items()):
                if j not in self.finished and now - moved > self.timeout:
                    self.lost(f"process {j} of {self.n} was lost (no heartbeat for "
                              f"{self.timeout:g} s, --peer-timeout); this process stops too")

    def lost(self, why: str) -> None:
        """Run the cleanup hooks and end the process with one line (silently with its own code
        when its work was already done)."""
        if not self.verdict.acquire(blocking=False):
            return
        if self.leaving is not None:
            _die(None, self.leaving)
        for hook in self.hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001, S110 - the line below matters more
                pass
        _die(f"{why}. Completed checkpoints are kept: restart every process, with --resume to "
             "continue", EXIT_PEER_LOST)


_WATCH: _Watch | None = None


def on_lost(hook: Callable[[], None]) -> None:
    """Call `hook` (e.g. remove an unfinished save) before a lost process ends this one."""
    if _WATCH is not None:
        _WATCH.hooks.append(hook)


def await_verdict() -> None:
    """After an unexpected error in a multi-process run (a collective failing because a peer
    died), give the watch time to name the lost process; it ends the process if so. Returns
    when no process was lost: the error is this process's own."""
    if _WATCH is not None and _WATCH.leaving is None:
        time.sleep(_WATCH.timeout + 3 * _WATCH.interval)


def leave(code: int) -> None:
    """Tell the other processes that this one ends with `code` (0: its work is done, so its
    silence afterwards is no loss; else they stop too)."""
    if _WATCH is None or _WATCH.leaving is not None:
        return
    _WATCH.leaving = code
    try:
        _WATCH.client.key_value_set(f"{_PREFIX}exit/{_WATCH.me}", str(code), True)
    except Exception:  # noqa: BLE001 - the store is gone; the peers' watches notice that
        pass
