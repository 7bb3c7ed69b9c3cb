"""Find the repeated block of a user's Flax NNX model and cut the rest of its loss into the part
before the blocks (embedding: `pre`) and the part after them (norm, head, loss: `post`).

The blocks are the largest node of the model graph that is either a list of modules with one
graphdef and equal parameter shapes (`nnx.List`, a list under `nnx.data`, `nnx.Sequential`'s
layers) or a module whose parameters all carry one leading layer axis (built by `nnx.vmap`,
run by `nnx.scan` or `lax.scan`). To find where they run, the user's loss is traced once
(`jax.make_jaxpr`) with the blocks swapped for stand-ins that only mark their input: in the
list case L marks in a chain, in the stacked case one mark in the body of a scan of length L.
What feeds the first mark is `pre`, what reads the last mark's output is `post`; both are
kept as jaxprs and run by `run` inside each pipeline stage (differentiable: every equation is
re-bound). Arrays a block is called with besides its input (a mask, positions) are `side`
inputs, recomputed on every stage from the micro-batch.
"""

from __future__ import annotations

import contextvars
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.extend import core as jcore

from oases_jax.errors import UserError

# The stand-in blocks bind this; it is only traced, never run.
mark_p = jcore.Primitive("parallelize_block")
mark_p.def_abstract_eval(lambda x, *side, index: x)
mark_p.def_impl(lambda x, *side, index: x)

_CALLS: contextvars.ContextVar[list | None] = contextvars.ContextVar("pz_calls", default=None)


class _StandIn(nnx.Module):
    """Takes a block's place: marks its input and returns it. `layers` > 0: stands for a stack,
    with a [layers] parameter for `nnx.scan`/`lax.scan` to slice."""

    def __init__(self, index: int, layers: int = 0):
        self.index = index
        if layers:
            self.layer_axis = nnx.Param(jnp.zeros((layers,), jnp.float32))

    def __call__(self, x, *args, **kwargs):
        leaves, tree = jax.tree.flatten((args, kwargs))
        is_array = [isinstance(a, (jax.Array, np.ndarray)) for a in leaves]
        arrays = [jnp.asarray(a) for a, arr in zip(leaves, is_array, strict=True) if arr]
        calls = _CALLS.get()
        if calls is not None:
            calls.append((tree, tuple(None if arr else a
                                      for a, arr in zip(leaves, is_array, strict=True))))
        return mark_p.bind(x, *arrays, index=self.index)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Where the repeated block sits: `path` in the model graph, list or stacked, L copies."""

    path: tuple
    stacked: bool
    count: int
    graphdef: Any  # one block's graphdef
    state: Any  # nnx.State of the first block (list) or of the stack (leaves [L, ...])
    size: int  # parameters of all blocks

    @property
    def name(self) -> str:
        return ".".join(str(k) for k in self.path) or "<model>"


def _params(node) -> list:
    return [v for _, v in nnx.iter_graph(node) if isinstance(v, nnx.Variable)]


def _list_blocks(path, node, why: list[str]) -> Blocks | None:
    mods = [m for m in node if isinstance(m, nnx.Module)]
    if len(mods) < 2 or len(mods) != len(node):
        return None
    split = [nnx.split(m) for m in mods]
    shapes = [jax.tree.map(lambda a: (a.shape, a.dtype), s) for _, s in split]
    for i, (gd, _) in enumerate(split[1:], 1):
        if gd != split[0][0] or shapes[i] != shapes[0]:
            why.append(f"{'.'.join(map(str, path))}[{i}] differs from [0] "
                       f"({'structure' if gd != split[0][0] else 'parameter shapes'})")
            return None
    size = len(mods) * sum(a.size for a in jax.tree.leaves(split[0][1]))
    return Blocks(tuple(path), False, len(mods), split[0][0], split[0][1], size)


def _stacked_blocks(path, node) -> Blocks | None:
    params = _params(node)
    if not params or not all(isinstance(v, nnx.Param) for v in params):
        return None
    lead = {v.get_value().shape[0] if v.get_value().ndim else 0 for v in params}
    if len(lead) != 1 or lead == {0} or min(lead) < 2:
        return None
    gd, state = nnx.split(node)
    size = sum(a.size for a in jax.tree.leaves(state))
    return Blocks(tuple(path), True, lead.pop(), gd, state, size)


def candidates(model: nnx.Module) -> tuple[list[Blocks], list[str]]:
    """Repeated-block candidates, largest first, and why near misses were refused."""
    found, why = [], []
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Variable) or not path:
            continue
        if isinstance(node, (list, tuple, nnx.List)):
            b = _list_blocks(path, list(node), why)
        elif isinstance(node, nnx.Module):
            b = _stacked_blocks(path, node)
        else:
            b = None
        if b is not None:
            found.append(b)
    # The largest first; of equal size the outermost (a Sequential before its layers list).
    found.sort(key=lambda b: (-b.size, len(b.path)))
    return found, why


def _replace(model, path: tuple, new) -> None:
    parent = model
    for k in path[:-1]:
        parent = parent[k] if isinstance(k, int) else getattr(parent, k)
    k = path[-1]
    if isinstance(k, int):
        parent[k] = new
    else:
        setattr(parent, k, new)


def _stand_ins(blocks: Blocks, original):
    if blocks.stacked:
        return _StandIn(-1, blocks.count)
    items = [_StandIn(i) for i in range(blocks.count)]
    if isinstance(original, nnx.List):
        return nnx.List(items)
    return nnx.data(type(original)(items))


# --- Cutting the traced loss --------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Part:
    """Equations of the traced loss that compute `outs` from the loss's inputs (and, for `post`,
    from the blocks' output `start`). `reads`: indices of the model's shared parameters used."""

    eqns: tuple
    outs: tuple
    reads: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Cut:
    """The loss of a model with its blocks cut out."""

    jaxpr: Any  # the whole traced loss (open jaxpr)
    consts: tuple
    n_shared: int  # invars: shared parameter leaves, then batch leaves
    pre: Part  # -> the first block's input
    side: Part  # -> the arrays every block is called with besides its input
    post: Part  # (block output) -> loss
    start: Any  # the var post reads the blocks' output from
    call: tuple  # (treedef, static leaves) of the block call's extra arguments
    act: jax.ShapeDtypeStruct  # one micro-batch's activation between blocks
    shared_paths: tuple  # the key paths of the shared leaves, in invar order


def _is_mark(eqn) -> bool:
    return eqn.primitive is mark_p


def _uses_blocks(eqn) -> bool:
    if _is_mark(eqn):
        return True
    return any(_uses_blocks(e) for sub in jcore.jaxprs_in_params(eqn.params) for e in sub.eqns)


def _part(jaxpr, outs, stop=(), n_shared: int = 0, what: str = "") -> Part:
    """Dead-code elimination from `outs` back to the inputs, not past the vars in `stop`."""
    need = {v for v in outs if isinstance(v, jcore.Var)} - set(stop)
    kept = []
    for eqn in reversed(jaxpr.eqns):
        if not any(v in need for v in eqn.outvars):
            continue
        if _uses_blocks(eqn):
            raise UserError(f"the loss reads a value inside the repeated block in {what}; "
                            f"parallelize() pipelines blocks that pass one array from one to "
                            f"the next: return only the blocks' last output to the rest of the "
                            f"model")
        kept.append(eqn)
        need |= {v for v in eqn.invars if isinstance(v, jcore.Var)} - set(stop)
    invars = list(jaxpr.invars)
    reads = tuple(i for i, v in enumerate(invars[:n_shared]) if v in need)
    return Part(tuple(reversed(kept)), tuple(outs), reads)


def run(part: Part, cut: Cut, shared: list, batch_leaves: list, start_value=None) -> list:
    """Evaluate a part (inside any transformation: every equation is bound again)."""
    env: dict = dict(zip(cut.jaxpr.constvars, cut.consts, strict=True))
    invars = cut.jaxpr.invars
    for i in part.reads:
        env[invars[i]] = shared[i]
    env.update(zip(invars[cut.n_shared:], batch_leaves, strict=True))
    if start_value is not None:
        env[cut.start] = start_value

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for eqn in part.eqns:
        params = eqn.primitive.get_bind_params(eqn.params)
        with eqn.ctx.manager:
            out = eqn.primitive.bind(*map(read, eqn.invars), **params)
        env.update(zip(eqn.outvars, out if eqn.primitive.multiple_results else [out],
                       strict=True))
    return [read(v) for v in part.outs]


def _scan_counts(eqn) -> tuple[int, int]:
    """(consts, carries) of a scan equation (jax <= 0.11 params, or 0.12's `ft_in`)."""
    if "num_consts" in eqn.params:
        return eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, _ = eqn.params["ft_in"].update(list(eqn.invars)).unpack()
    return len(list(consts)), len(list(carry))


def _find_marks(jaxpr, blocks: Blocks):
    """(first block's input, blocks' output, side inputs) as vars of the outer jaxpr."""
    marks = [e for e in jaxpr.eqns if _is_mark(e)]
    if not blocks.stacked:
        marks.sort(key=lambda e: e.params["index"])
        if [e.params["index"] for e in marks] != list(range(blocks.count)):
            return None
        for a, b in zip(marks, marks[1:], strict=False):
            if b.invars[0] is not a.outvars[0] or list(b.invars[1:]) != list(a.invars[1:]):
                raise UserError(f"the blocks of {blocks.name} are not called one after the "
                                f"other on the previous block's output with the same other "
                                f"arguments; parallelize() pipelines x = block(x, ...) chains")
        return marks[0].invars[0], marks[-1].outvars[0], list(marks[0].invars[1:])
    for eqn in jaxpr.eqns:
        if eqn.primitive.name != "scan" or not _uses_blocks(eqn):
            continue
        body = eqn.params["jaxpr"].jaxpr
        inner = [e for e in body.eqns if _is_mark(e)]
        nc, ncarry = _scan_counts(eqn)
        if len(inner) != 1 or eqn.params["length"] != blocks.count:
            return None
        mark = inner[0]
        if mark.invars[0] not in body.invars[nc:nc + ncarry]:
            return None
        k = body.invars.index(mark.invars[0]) - nc
        if body.outvars[k] is not mark.outvars[0]:
            return None
        side = []
        for v in mark.invars[1:]:
            if isinstance(v, jcore.Literal):
                side.append(v)
            elif v in body.invars and body.invars.index(v) < nc:
                side.append(eqn.invars[body.invars.index(v)])
            else:
                raise UserError(f"the blocks of {blocks.name} are called with an array that "
                                f"changes from layer to layer or is computed inside the loop; "
                                f"compute it before the loop, or pass per-layer values as "
                                f"block parameters")
        return eqn.invars[nc + k], eqn.outvars[k], side
    return None


def cut_loss(model, blocks: Blocks, loss_fn, batch, why: list[str]) -> Cut | None:
    """Trace `loss_fn(model, batch)` with the blocks swapped for stand-ins and cut it; None if
    the stand-ins were not called as blocks are (the candidate is not the repeated block: the
    reason is appended to `why` when the trace failed)."""
    graphdef, state = nnx.split(model)
    work = nnx.merge(graphdef, state)
    original = work
    for k in blocks.path:
        original = original[k] if isinstance(k, int) else getattr(original, k)
    _replace(work, blocks.path, _stand_ins(blocks, original))
    gd_cut, state_cut = nnx.split(work)
    inner = blocks.path
    flat = jax.tree_util.tree_flatten_with_path(state_cut)[0]
    shared_idx = [i for i, (p, _) in enumerate(flat) if keys_of(p)[:len(inner)] != inner]
    treedef = jax.tree.structure(state_cut)
    leaves = [a for _, a in flat]

    def loss(shared, batch):
        full = list(leaves)
        for i, a in zip(shared_idx, shared, strict=True):
            full[i] = a
        return loss_fn(nnx.merge(gd_cut, jax.tree.unflatten(treedef, full)), batch)

    shared = [leaves[i] for i in shared_idx]
    calls: list = []
    token = _CALLS.set(calls)
    try:
        closed = jax.make_jaxpr(loss)(shared, batch)
    except Exception as e:  # noqa: BLE001 - the model uses this candidate some other way
        first = (str(e).strip().splitlines() or [""])[0][:160]
        why.append(f"{blocks.name} is not called as x = block(x): {type(e).__name__}: {first}")
        return None
    finally:
        _CALLS.reset(token)
    jaxpr = closed.jaxpr
    found = _find_marks(jaxpr, blocks)
    if found is None or not calls:
        return None
    x_in, x_out, side = found
    if any(c != calls[0] for c in calls):
        raise UserError(f"the blocks of {blocks.name} are called with different static "
                        f"arguments (a layer index?); parallelize() runs one block program for "
                        f"every layer: pass what differs as block parameters")
    if (x_in.aval.shape, x_in.aval.dtype) != (x_out.aval.shape, x_out.aval.dtype):
        raise UserError(f"the blocks of {blocks.name} take {x_in.aval.str_short()} and return "
                        f"{x_out.aval.str_short()}; pipelined blocks keep the shape and dtype")
    if len(jaxpr.outvars) != 1 or jaxpr.outvars[0].aval.shape != ():
        raise UserError(f"loss_fn returned {[v.aval.str_short() for v in jaxpr.outvars]}; "
                        f"parallelize() needs loss_fn(model, batch) to return one scalar")
    n = len(shared)
    aval = x_in.aval
    return Cut(jaxpr, tuple(closed.consts), n,
               pre=_part(jaxpr, [x_in], n_shared=n, what="the embedding"),
               side=_part(jaxpr, side, n_shared=n, what="a block's arguments"),
               post=_part(jaxpr, jaxpr.outvars, stop=(x_out,), n_shared=n, what="the head"),
               start=x_out, call=calls[0], act=jax.ShapeDtypeStruct(aval.shape, aval.dtype),
               shared_paths=tuple(keys_of(flat[i][0]) for i in shared_idx))


def keys_of(path) -> tuple:
    return tuple(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
