"""Shape checks that need the mesh: done before anything is compiled, with one-line errors."""

from __future__ import annotations

import math

from jax.sharding import Mesh

from oases_jax.errors import UserError
from oases_jax.rules import ShardingRules, spec_divides


def _axes_size(rules: ShardingRules, logical: str, mesh: Mesh) -> tuple[str, int]:
    spec = rules.act_spec((logical,), mesh)
    axes = () if spec[0] is None else spec[0] if isinstance(spec[0], tuple) else (spec[0],)
    return "x".join(axes), math.prod(mesh.shape[a] for a in axes)


def check_shapes(*, batch_size: int, microbatches: int, seq_len: int, rules: ShardingRules,
                 mesh: Mesh, sub_batches: int = 1) -> None:
    """The micro-batch must split over the batch axes (and, per device, into the schedule's
    sub-batches), and the sequence over the axes a sequence-parallel rule set shards it on."""
    micro = batch_size // microbatches
    axes, n = _axes_size(rules, "batch", mesh)
    if spec_divides((micro,), rules.act_spec(("batch",), mesh), mesh) is not None:
        raise UserError(
            f"micro-batch of {micro} sequences (--batch-size {batch_size} / --microbatches "
            f"{microbatches}) does not split over mesh axis {axes}={n}; use a --batch-size that "
            f"is a multiple of {n * microbatches}"
        )
    if (micro // n) % sub_batches:
        raise UserError(
            f"each device's {micro // n} sequences (micro-batch {micro} over {axes or 'no axis'}"
            f"={n}) do not split into --sub-batches {sub_batches}; use a --batch-size that is a "
            f"multiple of {n * microbatches * sub_batches} or fewer sub-batches"
        )
    if spec_divides((seq_len,), rules.act_spec(("seq",), mesh), mesh) is not None:
        axes, n = _axes_size(rules, "seq", mesh)
        raise UserError(
            f"--seq-len {seq_len} does not split over mesh axis {axes}={n} (rules {rules.name} "
            f"shard the sequence); use a multiple of {n}"
        )
