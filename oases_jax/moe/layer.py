"""The MoE feed-forward under a schedule: gate, dispatch by all-to-all over `expert` (EP), the
experts' FFNs split over `tensor` (ESP), combine; one shard_map per layer. Without an active
setup (no mesh) it runs the same routing on the whole batch as one group of tokens.

Block shapes (one device): Bl sequences of Ll positions, T = Bl*Ll tokens, E experts (E/ep
local), C slots per expert per token group, D model width, F expert FFN width (F/mp local).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from oases_jax import compat
from oases_jax.errors import UserError
from oases_jax.moe import chunked, routing
from oases_jax.moe.schedules import get as get_schedule
from oases_jax.rules import ShardingRules, entry_axes

EXPERT_AXIS, TENSOR_AXIS = "expert", "tensor"



@dataclasses.dataclass(frozen=True, kw_only=True)
class MoESetup:
    """How a run's MoE layers execute: the schedule (`auto` or a `MOE_SCHEDULES` name),
    parm_s2's forward and backward chunk counts (0: the cost model's choice under `auto`, 2
    under parm_s2; `backward_chunks` 0: `chunks`'s), and the cost model `auto` asks
    (`oases_jax.moe.cost.choose_for_mesh`, passed in by the training layer: the
    runtime does not import the analysis tools); without one `auto` runs parm_s1."""

    schedule: str = "auto"
    chunks: int = 0
    backward_chunks: int = 0
    choose: Callable[..., tuple[str, int, int]] | None = None

    def __post_init__(self):
        for name in ("chunks", "backward_chunks"):
            if not 0 <= getattr(self, name) <= 64:
                raise UserError(f"MoE {name}={getattr(self, name)} must be in 0..64 (0: the "
                                "cost model's choice)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEArgs:
    """One MoE layer's routing: top-k, capacity factor, gates renormalised over the top k."""

    top_k: int
    capacity_factor: float
    norm_topk: bool = False


@dataclasses.dataclass(frozen=True)
class Axes:
    """The mesh axes an MoE layer uses: `batch` (the token-splitting axes of the residual
    stream, EP included), `ep` and `mp` (None when the mesh lacks them or they have size 1)."""

    batch: tuple[str, ...]
    ep: str | None
    mp: str | None
    sizes: dict

    @classmethod
    def of(cls, rules: ShardingRules, mesh: Mesh) -> Axes:
        def axes(name):
            return entry_axes(rules.act_spec((name,), mesh)[0])

        sizes = dict(mesh.shape)
        ep = EXPERT_AXIS if sizes.get(EXPERT_AXIS, 1) > 1 else None
        mlp = axes("mlp")
        mp = mlp[0] if len(mlp) == 1 else None
        batch = axes("batch")
        if ep and ep not in batch:
            raise UserError(f"mesh axis {ep}={sizes[ep]} does not split the batch under rules "
                            f"{rules.name!r}; MoE models need the expert axis as a batch axis "
                            "(rules dp, tp or tp_sp)")
        return cls(batch, ep, mp, sizes)

    def size(self, axis: str | None) -> int:
        return self.sizes.get(axis, 1) if axis else 1


_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("oases_jax_moe", default=None)


@contextlib.contextmanager
def use_moe(setup: MoESetup, rules: ShardingRules, mesh: Mesh):
    """MoE layers traced inside run as `setup` says on `mesh` under `rules`."""
    token = _ACTIVE.set((setup, rules, mesh))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


@dataclasses.dataclass(frozen=True)
class Choice:
    """A resolved schedule for one layer: its name and forward and backward chunk counts (1
    unless parm_s2)."""

    schedule: str
    chunks: int = 1
    backward_chunks: int = 1


def resolve(setup: MoESetup, axes: Axes, *, tokens: int, d_model: int, d_ff: int, experts: int,
            args: MoEArgs, dtype_bytes: int, mesh: Mesh, gated: bool, bias: bool = False
            ) -> Choice:
    """The schedule one layer runs: an explicit one (checked against the mesh), or `auto`:
    `local` without an expert axis, else the cheaper of parm_s1 and parm_s2 over forward and
    backward chunk counts under the alpha-beta model (`cost.choose`)."""
    if setup.schedule == "auto":
        if axes.ep is None:
            return Choice("local")
        if setup.choose is None:
            return Choice("parm_s1")
        fixed = (setup.chunks, setup.backward_chunks or setup.chunks) if setup.chunks else None
        name, chunks, bwd = setup.choose(
            mesh=mesh, ep_axis=axes.ep, mp_axis=axes.mp,
            pairs=((1, 1), fixed) if fixed else None, tokens=tokens,
            d_model=d_model, d_ff=d_ff, experts=experts, top_k=args.top_k,
            capacity_factor=args.capacity_factor, dtype_bytes=dtype_bytes, gated=gated, bias=bias,
            ep=axes.size(axes.ep), mp=axes.size(axes.mp),
            dp=math.prod(axes.size(a) for a in axes.batch) // axes.size(axes.ep))
        return Choice(name, chunks, bwd)
    spec = get_schedule(setup.schedule)
    if spec.needs_expert_axis and axes.ep is None:
        raise UserError(f"--moe-schedule {setup.schedule} needs an expert mesh axis of size > 1 "
                        f"and mesh {_mesh_str(axes.sizes)} has none; add one, e.g. --mesh "
                        "data=2,expert=2,tensor=2, or use --moe-schedule auto")
    if not spec.chunked:
        return Choice(spec.name)
    chunks = setup.chunks or 2
    return Choice(spec.name, chunks, setup.backward_chunks or chunks)


def _mesh_str(sizes: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in sizes.items())


ExpertFn = Callable[[Any, jax.Array], jax.Array]  # (local weights, buf [E_l, N, D]) -> partial


def moe_layer(x_BLD: jax.Array, router_DE: jax.Array, experts: Any, *, expert_fn: ExpertFn,
              bias_ED: jax.Array | None, names: Any, args: MoEArgs, gated: bool = False,
              with_routing: bool = False) -> tuple[jax.Array, dict]:
    """The MoE feed-forward of x: (output [B, L, D], {aux_loss, z_loss, dropped_frac}).
    `experts` is a pytree of [E, ...] weights with logical `names` (a matching pytree of
    tuples); `expert_fn` runs them on a slot buffer up to the ESP sum; `bias_ED` is added
    after it. `with_routing` adds each token's chosen experts and kept flags ([B, L, k] int32,
    "expert" and "kept") to the dict, for tests and tools."""
    active = _ACTIVE.get()
    n_experts = router_DE.shape[-1]
    if args.top_k > n_experts:
        raise UserError(f"MoE top_k={args.top_k} is more than n_experts={n_experts}; use "
                        f"top_k <= {n_experts}")
    if active is None:
        return _one_group(x_BLD, router_DE, experts, expert_fn, bias_ED, args, with_routing)
    setup, rules, mesh = active
    axes = Axes.of(rules, mesh)
    b, length, d = x_BLD.shape
    ep, mp = axes.size(axes.ep), axes.size(axes.mp)
    n_batch = math.prod(axes.size(a) for a in axes.batch)
    if n_experts % ep:
        raise UserError(f"n_experts={n_experts} does not split over mesh axis expert={ep}; use a "
                        f"number of experts divisible by {ep} or a smaller expert axis")
    if b % n_batch:
        raise UserError(f"batch of {b} sequences does not split over mesh axes "
                        f"{'x'.join(axes.batch)}={n_batch}; use a multiple of {n_batch}")
    choice = resolve(setup, axes, tokens=b * length // n_batch, d_model=d,
                     d_ff=_ff_width(experts, names), experts=n_experts, args=args,
                     dtype_bytes=jnp.dtype(x_BLD.dtype).itemsize, mesh=mesh, gated=gated,
                     bias=bias_ED is not None)
    spec = get_schedule(choice.schedule)
    if spec.dedup and length % mp:
        raise UserError(f"sequence length {length} does not split over mesh axis {axes.mp}={mp} "
                        f"(--moe-schedule {choice.schedule} de-duplicates tokens over it); use a "
                        f"multiple of {mp}")
    return _sharded(x_BLD, router_DE, experts, expert_fn, bias_ED, names, args, rules, mesh,
                    axes, choice, with_routing)


def _ff_width(experts, names) -> int:
    for w, n in zip(jax.tree.leaves(experts), jax.tree.leaves(
            names, is_leaf=lambda t: isinstance(t, tuple)), strict=True):
        if "mlp" in n:
            return w.shape[n.index("mlp")]
    raise ValueError("no expert weight has an `mlp` dimension")


def _routing_out(r: routing.Routing, shape) -> dict:
    return {"expert": r.expert_TK.reshape(*shape, -1).astype(jnp.int32),
            "kept": r.kept_TK.reshape(*shape, -1).astype(jnp.int32)}


def _one_group(x_BLD, router_DE, experts, expert_fn, bias_ED, args, with_routing=False):
    """No mesh: all tokens of the batch are one group."""
    b, length, d = x_BLD.shape
    x_TD = x_BLD.reshape(b * length, d)
    n_experts = router_DE.shape[-1]
    c = routing.capacity(x_TD.shape[0], n_experts, args.top_k, args.capacity_factor)
    r = routing.route(x_TD, router_DE, top_k=args.top_k, capacity=c, norm_topk=args.norm_topk)
    y = expert_fn(experts, routing.dispatch(x_TD, r, n_experts, c))
    if bias_ED is not None:
        y = y + bias_ED[:, None, :].astype(y.dtype)
    out_TD = routing.combine(y, r, c)
    losses = routing.router_losses(r.stats, args.top_k)
    if with_routing:
        losses |= _routing_out(r, (b, length))
    return out_TD.reshape(b, length, d), losses


def _exchange(buf_ESD, w_local, bias_local, expert_fn, axes: Axes) -> jax.Array:
    """Slots [E, S, D] -> expert outputs in the same slots: all-to-all over EP (each rank gets
    its E/ep experts' slots from every source), ESP all-gather over MP, the FFN on F/mp, ESP
    reduce-scatter, the output bias, all-to-all back."""
    ep, mp = axes.ep, axes.mp
    if ep:
        buf_ESD = jax.lax.all_to_all(buf_ESD, ep, 0, 1, tiled=True)  # [E/ep, ep*S, D]
    if mp:
        buf_ESD = jax.lax.all_gather(buf_ESD, mp, axis=1, tiled=True)  # [E/ep, mp*ep*S, D]
    y = expert_fn(w_local, buf_ESD)
    if mp:
        y = jax.lax.psum_scatter(y, mp, scatter_dimension=1, tiled=True)  # [E/ep, ep*S, D]
    if bias_local is not None:
        y = y + bias_local[:, None, :].astype(y.dtype)
    if ep:
        y = jax.lax.all_to_all(y, ep, 1, 0, tiled=True)  # [E, S, D]
    return y


def _sharded(x_BLD, router_DE, experts, expert_fn, bias_ED, names, args, rules, mesh,
             axes: Axes, choice: Choice, with_routing: bool):
    spec = get_schedule(choice.schedule)
    n_experts = router_DE.shape[-1]
    batch = axes.batch if len(axes.batch) != 1 else axes.batch[0]
    batch = batch or None
    seq = axes.mp if spec.dedup else None
    x_spec = jax.P(batch, seq, None)
    is_names = lambda t: isinstance(t, tuple)  # noqa: E731
    w_specs = jax.tree.map(lambda n: rules.param_spec(n, mesh), names, is_leaf=is_names)
    _check_expert_specs(w_specs, names, axes)
    b_spec = rules.param_spec(("expert", "embed"), mesh)
    group_axes = tuple(axes.batch) + ((axes.mp,) if spec.dedup and axes.mp else ())
    mp_size = axes.size(axes.mp)

    def local(x_blk, router, w_local, bias_local):
        # x_blk: [Bl, Ll, D]; Ll = L/mp under dedup schedules, L under ds_moe
        bl, ll, d = x_blk.shape
        x_TD = x_blk.reshape(bl * ll, d)
        t = x_TD.shape[0]
        if spec.dedup:
            c = routing.capacity(t, n_experts, args.top_k, args.capacity_factor)
            r = routing.route(x_TD, router, top_k=args.top_k, capacity=c,
                              norm_topk=args.norm_topk)
            if spec.chunked:
                slots = chunked.padded_slots(c, choice.chunks, choice.backward_chunks)
                buf = routing.dispatch(x_TD, r, n_experts, c, slots=slots)
                y = chunked.exchange(buf, w_local, bias_local, expert_fn, ep=axes.ep,
                                     mp=axes.mp, ep_size=axes.size(axes.ep), mp_size=mp_size,
                                     fwd_chunks=choice.chunks,
                                     bwd_chunks=choice.backward_chunks)
            else:
                buf = routing.dispatch(x_TD, r, n_experts, c)
                y = _exchange(buf, w_local, bias_local, expert_fn, axes)
            out_TD = routing.combine(y, r, c)
        else:  # ds_moe: gate all duplicated tokens, keep this MP rank's 1/mp of the slots
            c = routing.capacity(t, n_experts, args.top_k, args.capacity_factor, mp_size)
            r = routing.route(x_TD, router, top_k=args.top_k, capacity=c,
                              norm_topk=args.norm_topk)
            slots = c // mp_size
            offset = jax.lax.axis_index(axes.mp) * slots if axes.mp else 0
            buf = routing.dispatch(x_TD, r, n_experts, c, slots=slots, offset=offset)
            y = _exchange(buf, w_local, bias_local, expert_fn, axes)
            out_TD = routing.combine(y, r, c, offset=offset)
            if axes.mp:  # each rank combined its slots: the sum restores every token
                out_TD = jax.lax.psum(out_TD, axes.mp)
        stats = {k: _group_sum(v, group_axes) for k, v in r.stats.items()}
        losses = routing.router_losses(stats, args.top_k)
        if with_routing:
            losses |= _routing_out(r, (bl, ll))
        return out_TD.reshape(bl, ll, d), losses

    aux_spec = {k: jax.P() for k in ("aux_loss", "z_loss", "dropped_frac")}
    if with_routing:
        aux_spec |= {"expert": x_spec, "kept": x_spec}
    bias_in = bias_ED if bias_ED is not None else jnp.zeros((), x_BLD.dtype)
    b_in_spec = b_spec if bias_ED is not None else jax.P()

    def body(x_blk, router, w_local, bias_local):
        return local(x_blk, router, w_local, bias_local if bias_ED is not None else None)

    return jax.shard_map(body, mesh=compat.context_mesh(mesh),
                         in_specs=(x_spec, jax.P(), w_specs, b_in_spec),
                         out_specs=(x_spec, aux_spec))(x_BLD, router_DE, experts, bias_in)


def _group_sum(v: jax.Array, group_axes: tuple[str, ...]) -> jax.Array:
    """Sum of a per-group statistic over all token groups (a constant counts once per group)."""
    if not group_axes:
        return v
    missing = tuple(a for a in group_axes if a not in compat.varying_axes(v))
    if missing:
        v = jax.lax.pcast(v, missing, to="varying")
    return jax.lax.psum(v, group_axes)


def _check_expert_specs(w_specs, names, axes: Axes) -> None:
    """Expert weights split their `expert` dim over EP and their `mlp` dim over MP only."""
    is_names = lambda t: isinstance(t, tuple)  # noqa: E731
    for spec, n in zip(jax.tree.leaves(w_specs, is_leaf=lambda s: isinstance(s, jax.P)),
                       jax.tree.leaves(names, is_leaf=is_names), strict=True):
        entries = tuple(spec) + (None,) * (len(n) - len(spec))
        for name, entry in zip(n, entries, strict=True):
            want = {"expert": axes.ep, "mlp": axes.mp}.get(name)
            if entry != want:
                raise UserError(f"expert weight dim {name!r} is split over {entry!r} but an MoE "
                                f"layer needs {want!r}; use rules dp, tp or tp_sp (not fsdp)")
