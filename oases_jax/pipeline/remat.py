"""Merak's stage-aware recomputation: how many layers each pipeline stage recomputes.

Under 1F1B, stage i holds up to S-i micro-batches' activations and the last stage one, so the
early stages need recomputation most and the last none (its B follows its F at once). Merak
takes one ratio r0 for the first stage and sets r_i = 1 - (1 - r0)(S-1)/(S-1-i), i.e. keeps
(1 - r_i)(S-1-i) constant; stage i recomputes its first floor(n_i * r_i) layers. Ratios are exact
fractions, so floor(n_i * r_i) never loses a layer to rounding.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from oases_jax.errors import UserError

Ratio = int | float | str | Fraction


def exact_ratio(value: Ratio, what: str) -> Fraction:
    """A ratio as an exact fraction (a float by its shortest decimal: 0.8 is 4/5), in [0, 1]."""
    try:
        out = Fraction(repr(value) if isinstance(value, float) else value)
    except (TypeError, ValueError, ZeroDivisionError):
        raise UserError(f"{what}={value!r} is not a number: give a ratio in [0, 1]") from None
    if not 0 <= out <= 1:
        raise UserError(f"{what}={value!r} is outside [0, 1]: give the fraction of layers to "
                        f"recompute, 0 (none) to 1 (all)")
    return out


def ratio_text(value: Ratio) -> str:
    """A ratio as the flag spells it: a fraction with a short decimal as that decimal (4/5 is
    0.8, 1 is 1), any other as k/n (1/3)."""
    if not isinstance(value, Fraction):
        return str(value)
    text = f"{float(value):.12g}"
    return text if Fraction(text) == value else str(value)


def stage_ratios(stages: int, r0: Ratio, *, shifted: bool = False) -> tuple[Fraction, ...]:
    """Merak's per-stage ratios from the first stage's r0: r_i = 1 - (1 - r0)(S-1)/(S-1-i) for
    i < S-1, clamped to [0, 1], and r_{S-1} = 0. The formula falls with i and goes negative once
    (1 - r0)(S-1) > S-1-i: those stages recompute nothing (Merak disables their checkpointing).
    r0 = 1 recomputes every stage but the last. S = 1 has no pipeline and no last-stage rule:
    its one stage keeps r0. `shifted` (Merak's schedule, S >= 3) gives stage S-2 the ratio of
    S-3, as Merak does: that schedule holds three micro-batches there, as many as on S-3.

    S=4, r0=0.8 -> 4/5, 7/10, 2/5, 0."""
    if not isinstance(stages, int) or stages < 1:
        raise UserError(f"pipeline stages S={stages!r} must be a positive integer")
    r = exact_ratio(r0, "first-stage recompute ratio r0")
    if stages == 1:
        return (r,)
    last = stages - 1
    ratios = [min(Fraction(1), max(Fraction(0), 1 - (1 - r) * last / (last - i)))
              for i in range(last)] + [Fraction(0)]
    if shifted and stages >= 3:
        ratios[last - 1] = ratios[last - 2]
    return tuple(ratios)


def check_ratios(ratios: Sequence[Ratio], stages: int) -> tuple[Fraction, ...]:
    """An explicit per-stage list, checked: one ratio per stage, each in [0, 1]."""
    if len(ratios) != stages:
        given = ", ".join(map(ratio_text, ratios))
        raise UserError(f"{len(ratios)} recompute ratios ({given}) for S={stages} stages: give "
                        f"one per stage, or one first-stage ratio r0")
    return tuple(exact_ratio(r, f"recompute ratio of stage {i}") for i, r in enumerate(ratios))


def uniform_stage_layers(num_layers: int, stages: int) -> tuple[int, ...]:
    """floor(L/S) layers per stage, the first L mod S stages one more (DeepSpeed's and Merak's
    uniform partition: the extra layers balance the head and loss on the last stage)."""
    if num_layers < stages:
        raise UserError(f"{num_layers} layers cannot fill S={stages} pipeline stages: use at "
                        f"most {num_layers} stages")
    base, extra = divmod(num_layers, stages)
    return tuple(base + (i < extra) for i in range(stages))


def resolve_stage_layers(counts: Sequence[int] | None, num_layers: int, stages: int,
                         chunks: int = 1) -> tuple[int, ...]:
    """Per-stage layer counts: None for the uniform split, else `counts` (positive, as
    `PipelineConfig` holds them) checked for one per stage summing to the model's layers. With
    v `chunks` per stage (interleaved), every count must split into v equal chunks."""
    if counts is None:
        counts = uniform_stage_layers(num_layers, stages)
    else:
        counts = _explicit(tuple(counts), num_layers, stages)
    if chunks > 1 and any(n % chunks for n in counts):
        text = ",".join(map(str, counts))
        if num_layers % chunks == 0 and num_layers // chunks >= stages:
            fix = "e.g. " + ",".join(
                str(n * chunks) for n in uniform_stage_layers(num_layers // chunks, stages))
        else:
            fix = f"{num_layers} layers need v dividing them"
        raise UserError(f"stage layers {text} do not split into v={chunks} equal chunks per "
                        f"stage: give counts divisible by {chunks} ({fix}), or another v")
    return counts


def _explicit(counts: tuple[int, ...], num_layers: int, stages: int) -> tuple[int, ...]:
    text = ",".join(map(str, counts))
    if len(counts) != stages:
        raise UserError(f"stage layers {text} give {len(counts)} counts for S={stages} stages: "
                        f"give one per stage, e.g. {_example(num_layers, stages)}")
    if sum(counts) != num_layers:
        raise UserError(f"stage layers {text} sum to {sum(counts)}, but the model has "
                        f"{num_layers} layers: give counts that sum to {num_layers}, e.g. "
                        f"{_example(num_layers, stages)}")
    return counts


def _example(num_layers: int, stages: int) -> str:
    if num_layers < stages:
        return f"at most {num_layers} stages"
    return ",".join(map(str, uniform_stage_layers(num_layers, stages)))


def recomputed_layers(stage_layers: Sequence[int], ratios: Sequence[Fraction]) -> tuple[int, ...]:
    """floor(n_i * r_i): how many of stage i's layers (its first ones) are recomputed."""
    if len(stage_layers) != len(ratios):
        raise UserError(f"{len(ratios)} recompute ratios for {len(stage_layers)} stages: give "
                        f"one per stage")
    return tuple(math.floor(n * exact_ratio(r, f"recompute ratio of stage {i}"))
                 for i, (n, r) in enumerate(zip(stage_layers, ratios, strict=True)))
