"""Column- and row-parallel mapping of a block's linear layers over the `tensor` mesh axis.

A kernel with logical names (`nnx.with_partitioning`, `out_sharding=`) is mapped by the
project's Megatron rule set (`oases_jax.rules.megatron`: `heads`, `kv_heads`, `mlp`, `vocab`
on `tensor`). A kernel without names is mapped by data flow, read from one trace of the
block: every `dot_general` of a parameter with an activation is a linear layer. A layer that
reads the residual stream (no column layer upstream) is column-parallel (its first output
dimension is split: a widening layer, Merak's 1:4, or an attention projection, whose first
output dimension is the heads of a [D, H, K] kernel or H*K of a [D, H*K] one); a layer that
reads only column layers' outputs is row-parallel (its first contracted dimension is split:
the one that narrows back, 4:1, or the attention output). So Merak's fan-in:fan-out rule
decides 1:4 and 4:1 and the data flow decides the 1:1 layers it leaves ambiguous. A column
layer must be read by a row layer (else its split output would be gathered again), and every
split dimension, and every head count a split activation is reshaped into, must divide the
tensor size: otherwise a one-line UserError names the layer and the annotation that fixes it.
Biases of column layers are split with their kernel; everything else is replicated.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from oases_jax.errors import UserError
from oases_jax.rules import LOGICAL_AXES, megatron
from oases_jax.training.parallelize.block import ENTER, Op, Trace

TENSOR = "tensor"
# Equations that keep a parameter's dimensions (a transpose permutes them).
_SAME = {"convert_element_type", "copy", "copy_p", "reduce_precision", "transpose"}


def names_of(var: nnx.Variable) -> tuple | None:
    meta = var.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key):
            return tuple(meta[key])
    return None


def logical_spec(path: str, names: tuple, shape: tuple, t: int) -> tuple:
    """The `tensor` part of the Megatron rules' spec for a named parameter."""
    unknown = [n for n in names if n is not None and n not in LOGICAL_AXES]
    if unknown:
        raise UserError(f"parameter {path} names {unknown} in its sharding, which are not "
                        f"logical axis names; use words from {LOGICAL_AXES} (or no names)")
    table = dict(megatron().params)
    spec = tuple(TENSOR if table.get(n) == TENSOR and t > 1 else None for n in names)
    for dim, axis in zip(shape, spec, strict=True):
        if axis and dim % t:
            raise UserError(f"parameter {path} {shape} names {names}: dimension {dim} is not "
                            f"divisible by tensor={t}; pick a tensor size that divides {dim} "
                            f"or drop the name that maps it to tensor")
    return spec


@dataclasses.dataclass
class Linear:
    leaf: int  # the kernel's index among the block's parameter leaves
    act_in: int  # node of its activation input
    out: int
    free: tuple[int, ...]  # kernel dims kept in the output, in order
    contract: tuple[int, ...]  # kernel dims summed over
    op: Op  # its dot_general
    out_dim: dict  # kernel dim -> the output dimension it becomes
    kind: str = ""  # "column" | "row" | "replicated"


def _linears(ops: list, param_nodes: dict) -> tuple[list[Linear], set[int]]:
    """Every dot_general of one parameter with an activation; and the parameters used in any
    other way (left replicated)."""
    derived = {n: (leaf, tuple(range(len(aval.shape)))) for n, (leaf, aval)
               in param_nodes.items()}
    linears, other = [], set()
    for op in ops:
        got = [derived.get(n) for n in op.ins]
        if op.name in _SAME and got and got[0] is not None:
            leaf, perm = got[0]
            if op.name == "transpose":
                perm = tuple(perm[i] for i in op.params["permutation"])
            derived[op.outs[0]] = (leaf, perm)
            continue
        if op.name == "dot_general" and sum(g is not None for g in got) == 1:
            k = 0 if got[0] is not None else 1
            leaf, perm = got[k]
            (lc, rc), (lb, rb) = op.params["dimension_numbers"]
            contract, batch = (lc, lb) if k == 0 else (rc, rb)
            if batch:
                other.add(leaf)
                continue
            nd = len(op.in_avals[k].shape)
            ofree = [d for d in range(nd) if d not in contract]
            base = len(lb) + (len(op.in_avals[0].shape) - len(lc) - len(lb) if k == 1 else 0)
            linears.append(Linear(leaf, op.ins[1 - k], op.outs[0],
                                  tuple(perm[d] for d in ofree), tuple(perm[d] for d in contract),
                                  op, {perm[d]: base + i for i, d in enumerate(ofree)}))
            continue
        other.update(g[0] for g in got if g is not None)
    return linears, other


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """Per block parameter leaf: its `tensor` spec (per-layer dims); and one line per layer."""

    specs: tuple[tuple, ...]
    lines: tuple[str, ...]
    outputs: dict  # id(eqn) -> per output, the spec it is constrained to (None: left free)


def _fix(path: str, shape: tuple) -> str:
    whole = repr((None,) * len(shape))
    return (f"give the block's kernels logical names, which decide instead of the shape: "
            f"kernel_init=nnx.with_partitioning(init, {whole}) keeps {path} whole on every "
            f"tensor rank, ('embed', 'mlp') and ('mlp', 'embed') make a column/row pair")


def map_block(paths: list[str], names: list[tuple | None], tr: Trace, t: int) -> TensorMap:
    """`names`: each block leaf's logical names (per layer: a stack's leading name dropped)."""
    ops, param_nodes = tr.ops, tr.params
    shapes: list = [None] * len(paths)
    for leaf, aval in param_nodes.values():
        shapes[leaf] = tuple(aval.shape)
    linears, other = _linears(ops, param_nodes)
    specs: list = [(None,) * len(s) for s in shapes]
    named = {i for i, n in enumerate(names) if n is not None}
    for i in named:
        specs[i] = logical_spec(paths[i], names[i], shapes[i], t)
    # Nearest linear layers upstream of every node.
    up: dict[int, frozenset] = {}
    by_out = {lin.out: n for n, lin in enumerate(linears)}
    for op in ops:
        if op.outs and op.outs[0] in by_out:
            up[op.outs[0]] = frozenset({by_out[op.outs[0]]})
            continue
        u = frozenset().union(*(up.get(n, frozenset()) for n in op.ins if n is not None))
        for n in op.outs:
            up[n] = u
    lines = []
    for lin in linears:
        cols = {m for m in up.get(lin.act_in, ()) if linears[m].kind == "column"}
        others = up.get(lin.act_in, frozenset()) - cols
        path, shape = paths[lin.leaf], shapes[lin.leaf]
        fan = (f"{math.prod(shape[d] for d in lin.contract)}->"
               f"{math.prod(shape[d] for d in lin.free)}")
        if lin.leaf in named:
            split = [d for d, a in enumerate(specs[lin.leaf]) if a]
            lin.kind = ("column" if split and split[0] in lin.free else
                        "row" if split else "replicated")
            lines.append(f"{path} {fan}: {lin.kind} (logical names {names[lin.leaf]})")
            continue
        if cols and others:
            raise UserError(f"{path} ({fan}) reads both a column-parallel layer's output and "
                            f"the residual stream, so it is neither column nor row parallel; "
                            f"{_fix(path, shape)}")
        lin.kind = "row" if cols else "column"
        dims = lin.contract if cols else lin.free
        d = dims[0]
        if t > 1 and shape[d] % t:
            raise UserError(f"{path} ({fan}, {lin.kind}-parallel by its shape) cannot be split "
                            f"over tensor={t}: dimension {d} ({shape[d]}) is not divisible by "
                            f"{t}; use a tensor size that divides {shape[d]}, or "
                            f"{_fix(path, shape)}")
        specs[lin.leaf] = tuple(TENSOR if i == d and t > 1 else None for i in range(len(shape)))
        lines.append(f"{path} {fan}: {lin.kind} (by shape and data flow)")
    _check_pairs(linears, up, paths, shapes, named)
    _check_heads(ops, up, linears, t, {n: math.prod(shapes[lin.leaf][d] for d in lin.free)
                                        for n, lin in enumerate(linears)}, paths)
    biases = _bias_specs(paths, shapes, specs, linears, named)
    if biases:
        lines.append("biases split with their column kernels: " + ", ".join(biases))
    rest = sorted(set(range(len(paths))) - {lin.leaf for lin in linears} - named - set(
        paths.index(b) for b in biases))
    if rest:
        lines.append("replicated: " + ", ".join(paths[i] for i in rest))
    return TensorMap(tuple(specs), tuple(lines), _output_specs(tr, linears, up, specs, t))


def _output_specs(tr: Trace, linears, up, specs, t) -> dict:
    """Megatron's activations: a column layer's output split where its kernel is; every float
    value computed from the block's input with no column layer upstream (the residual stream,
    norms, a row layer's output, whose partial sums are all-reduced right there) whole.
    Values inside a custom derivative or a remat are left to the partitioner (running those
    piecewise would change their autodiff)."""
    if t == 1:
        return {}
    column = {lin.out: lin for lin in linears if lin.kind == "column"}
    cols = {n for n, lin in enumerate(linears) if lin.kind == "column"}
    acts = set(tr.acts)
    avals = {}
    for op in tr.ops:
        avals.update(zip(op.outs, op.out_avals, strict=True))
        if any(n in acts for n in op.ins):
            acts.update(op.outs)

    def spec(node):
        aval = avals.get(node)
        if aval is None:
            return None
        if node in column:
            lin = column[node]
            d = next(i for i, a in enumerate(specs[lin.leaf]) if a)
            return tuple(TENSOR if i == lin.out_dim[d] else None for i in range(aval.ndim))
        if (node in acts and aval.ndim and jnp.issubdtype(aval.dtype, jnp.floating)
                and not up.get(node, frozenset()) & cols):
            return (None,) * aval.ndim
        return None

    outputs = {}
    for key, outs in tr.outs.items():
        if any(c.primitive.name not in ENTER for c in tr.calls[key]):
            continue
        eqn_specs = tuple(spec(n) for n in outs)
        if any(x is not None for x in eqn_specs):
            outputs[key] = eqn_specs
    return outputs


def _check_pairs(linears, up, paths, shapes, named) -> None:
    read_by_row = set()
    for lin in linears:
        if lin.kind == "row":
            read_by_row |= set(up.get(lin.act_in, ()))
    for n, lin in enumerate(linears):
        if lin.kind == "column" and lin.leaf not in named and n not in read_by_row:
            p, s = paths[lin.leaf], shapes[lin.leaf]
            raise UserError(f"{p} {s} maps to column parallel (it reads the residual stream) "
                            f"but no later layer narrows its output back, so its split output "
                            f"would be gathered again; {_fix(p, s)}")


def _check_heads(ops, up, linears, t, width: dict, paths) -> None:
    """A split activation reshaped into heads: the head count must divide t."""
    if t == 1:
        return
    for op in ops:
        if op.name != "reshape" or op.ins[0] is None:
            continue
        u = up.get(op.ins[0], frozenset())
        if not u or any(linears[m].kind != "column" for m in u):
            continue
        a, b = tuple(op.in_avals[0].shape), tuple(op.out_avals[0].shape)
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        ra = tuple(d for d in a[k:] if d != 1)
        rb = tuple(d for d in b[k:] if d != 1)
        split = {width[m] for m in u}
        if ra == rb or not ra or not rb or (len(ra) > 1 and len(rb) > 1) \
                or math.prod(ra) not in split:
            continue
        heads = rb[0] if len(ra) == 1 else ra[0]
        if heads % t:
            layers = ", ".join(sorted(paths[linears[m].leaf] for m in u))
            raise UserError(f"the output of column-parallel {layers} is reshaped {a} -> {b}: "
                            f"{heads} heads do not divide over tensor={t}; use a tensor size "
                            f"that divides {heads}, or annotate the attention kernels with "
                            f"logical names (None names keep them replicated)")


def _bias_specs(paths, shapes, specs, linears, named) -> list[str]:
    """A column layer's bias (the sibling `bias` of its kernel, shaped like the kernel's output
    dims) is split as the kernel's first output dim."""
    index = {p: i for i, p in enumerate(paths)}
    out = []
    for lin in linears:
        if lin.kind != "column" or lin.leaf in named:
            continue
        path = paths[lin.leaf]
        if not path.endswith("kernel"):
            continue
        b = index.get(path[: -len("kernel")] + "bias")
        dims = tuple(shapes[lin.leaf][d] for d in lin.free)
        if b is not None and b not in named and shapes[b] == dims and any(specs[lin.leaf]):
            specs[b] = (TENSOR,) + (None,) * (len(dims) - 1)
            out.append(paths[b])
    return out
