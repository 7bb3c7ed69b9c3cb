"""Pipeline actions: what one stage does with one micro-batch, the transfers it implies, and what
it waits for. Everything above this module (schedules, tick tables, the validator and the event
simulator) reads these rules from here, so there is one definition of each kind."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

# F    forward. Keeps the stage input, plus every activation its recompute (if any) will not redo.
# PF   Merak's pre-checkpoint forward: a forward whose recompute is hoisted (always an RrG).
# R    recompute, run after the gradient arrives (the recompute half of a rematted backward).
# RrG  Merak's recompute-before-receiving-the-gradient: the same recompute, hoisted into a bubble.
# B    backward; in a split (zero-bubble) schedule only the input gradient.
# W    weight gradient of a split backward (zero-bubble).
# IDLE a tick where a stage waits; only tick tables hold it, never a stage's action list.
KINDS = ("IDLE", "F", "PF", "R", "RrG", "B", "W")
FORWARDS = ("F", "PF")
RECOMPUTES = ("R", "RrG")
CODES = {kind: i for i, kind in enumerate(KINDS)}  # op codes for a tick table's executor


class InvalidSchedule(ValueError):
    """A schedule that breaks a dependency, repeats or misses work, or deadlocks."""


@dataclasses.dataclass(frozen=True)
class Transfer:
    """One stage-to-stage message: an activation forward (virtual stage j -> j+1) or a gradient
    backward (j -> j-1) of micro-batch `mb`. Virtual stage j lives on device j % S."""

    kind: str  # "act" or "grad"
    mb: int
    src: int  # virtual stage
    dst: int

    def devices(self, stages: int) -> tuple[int, int]:
        return self.src % stages, self.dst % stages

    def wraps(self, stages: int) -> bool:
        """True for the edge that closes a ring: device S-1 -> 0 for an activation (interleaved:
        chunk c's end feeds chunk c+1's start) and 0 -> S-1 for a gradient."""
        src, dst = self.devices(stages)
        return stages > 1 and (src, dst) == ((stages - 1, 0) if self.kind == "act"
                                             else (0, stages - 1))

    def __str__(self) -> str:
        return f"{self.kind}{self.mb} {self.src}->{self.dst}"


@dataclasses.dataclass(frozen=True)
class Action:
    """`kind` of micro-batch `mb` on `chunk` (the device's chunk-th model part: virtual stage
    chunk*S + device), with the transfers it receives before it runs and sends after it."""

    kind: str
    mb: int
    chunk: int = 0
    recvs: tuple[Transfer, ...] = ()
    sends: tuple[Transfer, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"action kind {self.kind!r} is not one of {', '.join(KINDS)}")

    def label(self, chunks: int = 1) -> str:
        """`F3` (micro-batch 3), `F3.1` (its chunk 1 when the device holds several)."""
        if self.kind == "IDLE":
            return "."
        return f"{self.kind}{self.mb}" + (f".{self.chunk}" if chunks > 1 else "")

    def bare(self) -> Action:
        """The action without its transfers (what a builder writes before wiring)."""
        if not (self.recvs or self.sends):
            return self
        return Action(self.kind, self.mb, self.chunk)


IDLE = Action("IDLE", -1)


def vstage(stage: int, action: Action, stages: int) -> int:
    """The virtual stage an action of device `stage` runs (Megatron's interleaved placement)."""
    return action.chunk * stages + stage


def event(kind: str, mb: int, j: int) -> tuple[str, int, int]:
    """The key of the result an action produces: `fwd`, `rec`, `bwd` or `w` of (mb, j)."""
    return ({"F": "fwd", "PF": "fwd", "R": "rec", "RrG": "rec", "B": "bwd", "W": "w"}[kind], mb, j)


def inputs(kind: str, mb: int, j: int, virtual: int, recomputed: bool
           ) -> list[tuple[tuple[str, int, int], bool]]:
    """What an action on virtual stage j (of `virtual`) waits for: (event key, crosses a link).

    F/PF wait for the previous stage's forward; R for its own forward and the gradient; RrG for
    its own forward only (that is the point of hoisting it); B for its own forward, its
    recompute when it has one, and the gradient (the last stage makes its own); W for its B.
    """
    own_fwd = (("fwd", mb, j), False)
    grad = [(("bwd", mb, j + 1), True)] if j + 1 < virtual else []
    if kind in FORWARDS:
        return [(("fwd", mb, j - 1), True)] if j > 0 else []
    if kind == "R":
        return [own_fwd, *grad]
    if kind == "RrG":
        return [own_fwd]
    if kind == "B":
        return [own_fwd, *grad, *([(("rec", mb, j), False)] if recomputed else [])]
    if kind == "W":
        return [(("bwd", mb, j), False)]
    raise InvalidSchedule(f"{kind} is not work a stage's action list may hold")


def wire(stages: Sequence[Iterable[Action]], chunks: int) -> tuple[tuple[Action, ...], ...]:
    """Attach to each action the transfers it implies. An activation is sent after F/PF and
    received before the next stage's F/PF; a gradient is sent after B and received before the
    first action that needs it: R if that micro-batch recomputes after the gradient, else B
    (an RrG receives nothing: it runs before the gradient is there)."""
    n = len(stages)
    virtual = n * chunks
    lists = [[a.bare() for a in acts] for acts in stages]
    late_recompute = {(a.mb, vstage(s, a, n)) for s, acts in enumerate(lists) for a in acts
                      if a.kind == "R"}
    out = []
    for s, acts in enumerate(lists):
        wired = []
        for a in acts:
            j = vstage(s, a, n)
            recvs: list[Transfer] = []
            sends: list[Transfer] = []
            if a.kind in FORWARDS:
                if j > 0:
                    recvs.append(Transfer("act", a.mb, j - 1, j))
                if j + 1 < virtual:
                    sends.append(Transfer("act", a.mb, j, j + 1))
            elif a.kind == "B" or a.kind == "R":
                gets_grad = (a.kind == "R") == ((a.mb, j) in late_recompute)
                if j + 1 < virtual and gets_grad:
                    recvs.append(Transfer("grad", a.mb, j + 1, j))
                if a.kind == "B" and j > 0:
                    sends.append(Transfer("grad", a.mb, j, j - 1))
            wired.append(Action(a.kind, a.mb, a.chunk, tuple(recvs), tuple(sends)))
        out.append(tuple(wired))
    return tuple(out)
