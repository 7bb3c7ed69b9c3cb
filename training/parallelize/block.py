"""One block of a user's model as a traced program: traced once (`trace`), read as a flat graph
of operations over integer nodes (jit calls and custom derivatives inlined), and run again
(`run`) with sharding constraints on chosen equations' outputs.

Running the trace rather than calling the module is how `parallelize()` puts Megatron's
activation shardings into a block it did not write: the tensor map (`tensor.map_block`) says
which outputs are split on `tensor` (column layers' outputs) and which stay whole (the residual
stream, norms, row layers' outputs after their all-reduce), and `run` constrains exactly those.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax import compat

_OPAQUE = {"scan", "while", "cond"}  # loops and branches stay one operation
ENTER = {"jit", "pjit", "closed_call", "core_call"}  # calls `run` inlines (no AD change)


@dataclasses.dataclass
class Op:
    name: str
    params: dict
    ins: list  # node ids (None for literals)
    outs: list
    in_avals: list
    out_avals: list
    eqn: Any
    calls: tuple  # the call equations it sits in, outermost first


@dataclasses.dataclass(frozen=True)
class Trace:
    """A block traced on (parameter leaves, x, side arrays)."""

    closed: Any  # ClosedJaxpr
    ops: tuple[Op, ...]
    params: dict  # param node -> (leaf index, aval)
    acts: frozenset  # nodes of x and the side arrays
    outs: dict  # id(eqn) -> its output nodes, for every equation at any depth
    calls: dict  # id(eqn) -> the call equations it sits in


def _flatten(jaxpr, ins: list, ops: list, counter: list, outs_of: dict, calls_of: dict,
             calls: tuple = ()) -> list:
    env = dict(zip(jaxpr.invars, ins, strict=True))

    def fresh():
        counter[0] += 1
        return counter[0]

    for v in jaxpr.constvars:
        env[v] = fresh()

    def read(v):
        return None if isinstance(v, jcore.Literal) else env[v]

    for eqn in jaxpr.eqns:
        in_nodes = [read(v) for v in eqn.invars]
        subs = list(jcore.jaxprs_in_params(eqn.params))
        if (eqn.primitive.name not in _OPAQUE and len(subs) == 1
                and len(subs[0].invars) == len(eqn.invars)
                and len(subs[0].outvars) == len(eqn.outvars)):
            outs = _flatten(subs[0], in_nodes, ops, counter, outs_of, calls_of, calls + (eqn,))
        else:
            outs = [fresh() for _ in eqn.outvars]
            ops.append(Op(eqn.primitive.name, dict(eqn.params), in_nodes, outs,
                          [v.aval for v in eqn.invars], [v.aval for v in eqn.outvars], eqn,
                          calls))
        outs_of[id(eqn)] = outs
        calls_of[id(eqn)] = calls
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def trace(block_fn, leaves: list, act, side: list) -> Trace:
    closed = jax.make_jaxpr(block_fn)(leaves, act, side)
    jaxpr = closed.jaxpr
    ins = list(range(1, len(jaxpr.invars) + 1))
    ops: list = []
    outs_of: dict = {}
    calls_of: dict = {}
    _flatten(jaxpr, ins, ops, [len(ins)], outs_of, calls_of)
    params = {ins[i]: (i, v.aval) for i, v in enumerate(jaxpr.invars[:len(leaves)])}
    return Trace(closed, tuple(ops), params, frozenset(ins[len(leaves):]), outs_of, calls_of)


def run(tr: Trace, specs: dict, mesh, args: list) -> list:
    """Evaluate the traced block on `args` (leaves, x, side), the outputs of each equation in
    `specs` (id(eqn) -> one PartitionSpec tuple or None per output) constrained so. Calls are
    inlined where they hold a constrained equation; custom derivatives and remat are bound
    whole, as traced."""
    enter = {id(c) for k in specs for c in tr.calls.get(k, ()) if c.primitive.name in ENTER}

    def go(jaxpr, consts, values):
        env = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, values, strict=True))

        def read(v):
            return v.val if isinstance(v, jcore.Literal) else env[v]

        for eqn in jaxpr.eqns:
            ins = [read(v) for v in eqn.invars]
            if id(eqn) in enter:
                sub = next(p for p in eqn.params.values() if isinstance(p, jcore.ClosedJaxpr))
                outs = go(sub.jaxpr, sub.consts, ins)
            else:
                with eqn.ctx.manager:
                    out = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
                outs = list(out) if eqn.primitive.multiple_results else [out]
                for i, spec in enumerate(specs.get(id(eqn), ())):
                    if spec is not None:
                        sharding = NamedSharding(compat.context_mesh(mesh), P(*spec))
                        outs[i] = jax.lax.with_sharding_constraint(outs[i], sharding)
            env.update(zip(eqn.outvars, outs, strict=True))
        return [read(v) for v in jaxpr.outvars]

    return go(tr.closed.jaxpr, tr.closed.consts, args)
