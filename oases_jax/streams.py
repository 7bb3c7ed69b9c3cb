"""The two-stream engine: the one rule by which the planner's layer replay
(`oases_jax.planner.cost.layer_cost`), the inspection simulator
(`oases_jax.tools.analysis.simulate`) and the MoE cost model (`oases_jax.moe.cost`) turn work into
seconds.

Work is a program-order list of tasks, each on a stream (`COMPUTE`, or a collective stream such
as `COMM`): a task starts when its stream has finished the tasks added to it before and the
tasks it depends on have ended, as XLA's GPU runtime runs each stream's ops in schedule order.
A collective issued by the compute stream (`issue`) also waits for the compute issued before it.
Alongside the times, the engine counts per collective kind the seconds compute on the compute
stream runs inside each collective's window: a collective with a GEMM beside it is not hidden,
only the time compute covers is.

`replay` runs the op-list form the planner builds per layer:

    ("c", s):          compute for s seconds
    ("start", key, s): collective `key` (s seconds), issued by the compute stream
    ("done", key):     the compute stream waits for collective `key`
    ("sync",):         the compute stream waits for every collective in flight

so a collective hides behind exactly the compute issued between its start and its done, and a
stage of an overlapped schedule costs max(compute, comm).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

COMPUTE = "compute"
COMM = "comm"

Op = tuple  # ("c", seconds) | ("start", key, seconds) | ("done", key) | ("sync",)


@dataclasses.dataclass(frozen=True)
class Window:
    """One collective's time on its stream and the seconds of it compute covers."""

    name: str
    kind: str
    start: float
    end: float
    covered_s: float

    @property
    def share(self) -> float:
        return self.covered_s / (self.end - self.start) if self.end > self.start else 1.0


@dataclasses.dataclass
class Event:
    """One task on the timeline (`Streams(events=N)` keeps the first N)."""

    stream: str
    name: str
    kind: str
    start: float
    end: float


class Streams:
    """Tasks on streams in program order (module docstring). `add` returns a task id that
    later tasks may depend on; `end(i)` is when task i finishes."""

    def __init__(self, *, events: int = 0):
        self.ends: list[float] = []
        self.free: dict[str, float] = {}
        self.busy: dict[str, float] = {}
        self.events: list[Event] = []
        self._max_events = events
        # Collective windows: [start, end, kind, seconds compute covers, name]; `_open` those
        # a later compute task may still cover (compute starts only grow on its stream).
        self._windows: list[list] = []
        self._open: list[list] = []
        self._compute: list[tuple[float, float]] = []  # compute tasks' (start, end)

    def add(self, stream: str, seconds: float, deps: Iterable[int] = (), *, kind: str = "",
            name: str = "", issued: bool = False) -> int:
        """A task of `seconds` on `stream` after `deps` (task ids); `issued`: also after the
        compute stream's tasks so far (a collective the compute stream starts). `kind` names a
        collective's kind for the coverage count (default: its stream)."""
        start = self.free.get(stream, 0.0)
        for d in deps:
            start = max(start, self.ends[d])
        if issued:
            start = max(start, self.free.get(COMPUTE, 0.0))
        end = start + seconds
        self.ends.append(end)
        self.free[stream] = end
        self.busy[stream] = self.busy.get(stream, 0.0) + seconds
        if stream == COMPUTE:
            self._cover(start, end)
        else:
            self._window(start, end, kind or stream, name)
        if len(self.events) < self._max_events and end > start:
            self.events.append(Event(stream, name, kind or stream, start, end))
        return len(self.ends) - 1

    def issue(self, seconds: float, *, kind: str = "", name: str = "", stream: str = COMM) -> int:
        """A collective the compute stream issues now (`add(..., issued=True)`)."""
        return self.add(stream, seconds, kind=kind, name=name, issued=True)

    def wait(self, *tasks: int, stream: str = COMPUTE) -> None:
        """`stream` waits for `tasks` (an async collective's done)."""
        for t in tasks:
            self.free[stream] = max(self.free.get(stream, 0.0), self.ends[t])

    def sync(self, stream: str = COMPUTE) -> None:
        """`stream` waits for every task so far."""
        self.free[stream] = self.makespan

    def end(self, task: int) -> float:
        return self.ends[task]

    @property
    def makespan(self) -> float:
        return max([0.0, *self.ends, *self.free.values()])

    @property
    def compute_s(self) -> float:
        return self.busy.get(COMPUTE, 0.0)

    @property
    def comm_s(self) -> float:
        return sum(s for k, s in self.busy.items() if k != COMPUTE)

    def covered(self) -> dict[str, tuple[float, float]]:
        """Per collective kind: (its seconds, the seconds of them compute covers)."""
        out: dict[str, list[float]] = {}
        for start, end, kind, cov, _ in self._windows:
            tally = out.setdefault(kind, [0.0, 0.0])
            tally[0] += end - start
            tally[1] += cov
        return {k: (s, c) for k, (s, c) in out.items()}

    def windows(self) -> list[Window]:
        """Every collective in program order, with the seconds of it compute covers."""
        return [Window(name, kind, start, end, cov)
                for start, end, kind, cov, name in self._windows]

    def _cover(self, start: float, end: float) -> None:
        """Compute on [start, end] covers the part of each collective window it overlaps."""
        self._compute.append((start, end))
        if end <= start:
            return
        self._open = [w for w in self._open if w[1] > start]
        for w in self._open:
            w[3] += max(0.0, min(end, w[1]) - max(start, w[0]))

    def _window(self, start: float, end: float, kind: str, name: str) -> None:
        """A collective on [start, end]: covered by compute already placed inside it (tasks of
        a dependency graph may start before compute added earlier ends) and by later compute."""
        w = [start, end, kind, 0.0, name]
        for cs, ce in reversed(self._compute):
            if ce <= start:
                break
            w[3] += max(0.0, min(ce, end) - max(cs, start))
        self._windows.append(w)
        if end > start:
            self._open.append(w)


def replay(ops: Sequence[Op], *, overlap: bool = True) -> tuple[float, float, float]:
    """(time, compute, comm) of an op list (module docstring). Without `overlap` (synchronous
    collectives) every collective runs alone at its start."""
    s = Streams()
    pending: dict = {}
    for op in ops:
        if op[0] == "c":
            s.add(COMPUTE, op[1])
        elif op[0] == "sync":
            s.wait(*pending.values())
            pending.clear()
        elif op[0] == "start":
            task = s.issue(op[2])
            if overlap:
                pending[op[1]] = task
            else:
                s.wait(task)
        else:
            task = pending.pop(op[1], None)
            if task is not None:
                s.wait(task)
    return s.makespan, s.compute_s, s.comm_s


__all__ = ["COMM", "COMPUTE", "Event", "Op", "Streams", "Window", "replay"]
