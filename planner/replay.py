"""The two-stream replay that turns a layer's op list into seconds, the same rule as the
inspection simulator's (`oases_jax.tools.analysis.simulate`): work is a list of ops on two streams,
compute and communication.

    compute c:   runs on the compute stream
    start i, m:  collective i (m seconds) starts when the compute stream has issued it and the
                 communication stream is free
    done i:      the compute stream waits for collective i
    sync:        the compute stream waits for every collective in flight

So a collective hides behind exactly the compute issued between its start and its done, and a
stage of an overlapped schedule costs max(compute, comm).
"""

from __future__ import annotations

from collections.abc import Sequence

Op = tuple  # ("c", seconds) | ("start", key, seconds) | ("done", key) | ("sync",)


def replay(ops: Sequence[Op], *, overlap: bool = True) -> tuple[float, float, float]:
    """(time, compute, comm) of an op list under the two-stream rules in the module docstring.
    Without `overlap` (synchronous collectives) every collective runs alone at its start."""
    tc = tm = compute = comm = 0.0
    pending: dict = {}
    for op in ops:
        if op[0] == "c":
            tc += op[1]
            compute += op[1]
        elif op[0] == "sync":
            tc = max([tc, *pending.values()])
            pending.clear()
        elif op[0] == "start":
            comm += op[2]
            begin = max(tc, tm)
            tm = begin + op[2]
            if overlap:
                pending[op[1]] = tm
            else:
                tc = tm
        else:
            tc = max(tc, pending.pop(op[1], tc))
    for end in pending.values():
        tc = max(tc, end)
    return max(tc, tm), compute, comm
