"""One pipeline's settings as parsed values (`PipelineConfig`), read by the run's config, the
layout it resolves to (`training.pipeline_layout.PipelineSpec`), `parallelize()`, the plan file
and the benches; `from_flags` parses the command line's spelling of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from fractions import Fraction

from oases_jax.errors import UserError
from oases_jax.pipeline import registry
from oases_jax.pipeline.remat import Ratio, check_ratios, exact_ratio, ratio_text, stage_ratios

MAX_BACKWARD_TICKS = 8
# `--fused-ticks` and `--split-head` as the config holds them.
FUSED_TICKS: Mapping[str, bool | None] = {"auto": None, "on": True, "off": False}
SPLIT_HEAD: Mapping[str, bool] = {"on": True, "off": False}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PipelineConfig:
    """A pipeline over the mesh's `stage` axis: the schedule (`oases_jax.pipeline.registry`),
    layers per stage (None: uniform), model chunks per stage (0: the schedule's), Merak's
    stage-aware recompute ratios (one value: r0, Merak's rule for the other stages; one per
    stage; None: none), the ticks one backward spans (0: one), whether a tick holds a stage's
    forward, recompute and backward together (None: where that is faster in lockstep,
    `PipelineSpec.fused`) and whether the head is split over the stages by positions.

    What needs only the schedule's record is checked here; the stage count, the model's layers
    and the mesh are checked where they are known (`ratios_for`, `PipelineSpec.of`,
    `training.config.ParallelConfig`). Sequences become tuples and ratios exact fractions."""

    schedule: str
    stage_layers: tuple[int, ...] | None = None
    virtual_stages: int = 0
    remat_ratios: tuple[Fraction, ...] | None = None
    backward_ticks: int = 0
    fused_ticks: bool | None = None
    split_head: bool = False

    def __post_init__(self):
        spec = registry.get(self.schedule)
        if self.stage_layers is not None:
            object.__setattr__(self, "stage_layers", _counts(self.stage_layers))
        if self.remat_ratios is not None:
            object.__setattr__(self, "remat_ratios", _ratios(self.remat_ratios))
        if self.virtual_stages < 0:
            raise UserError(f"--virtual-stages {self.virtual_stages} must be >= 2 (or 0: the "
                            f"schedule's default)")
        if self.virtual_stages != 1:  # 1 is every schedule's one chunk
            spec.check_chunks(self.virtual_stages)
        if not 0 <= self.backward_ticks <= MAX_BACKWARD_TICKS:
            raise UserError(f"--backward-ticks {self.backward_ticks} must be 1 to "
                            f"{MAX_BACKWARD_TICKS} (or 0: the schedule's default)")
        if not (self.fused_ticks is None or isinstance(self.fused_ticks, bool)):
            raise UserError(f"fused_ticks={self.fused_ticks!r} must be True, False or None "
                            f"(auto); --fused-ticks takes auto, on or off")
        if not isinstance(self.split_head, bool):
            raise UserError(f"split_head={self.split_head!r} must be True or False; "
                            f"--split-head takes on or off")
        if self.fused_ticks and self.backward_ticks > 1:
            raise UserError(f"--fused-ticks on runs each backward in one tick, not "
                            f"--backward-ticks {self.backward_ticks}; drop one of them")

    @classmethod
    def from_flags(cls, *, pipeline: str | None, stage_layers: str | None = None,
                   virtual_stages: int = 0, remat_ratios: str | None = None,
                   backward_ticks: int = 0, fused_ticks: str = "auto",
                   split_head: str = "off") -> PipelineConfig | None:
        """The config the command line's flags give (`training.flags.add_layout_flags`):
        `--stage-layers 5,6,6,7`, `--remat-ratios 0.8` (or one per stage), `--fused-ticks
        auto|on|off`, `--split-head on|off`; None without `--pipeline`, which the others
        need. Empty text is the default."""
        if fused_ticks not in FUSED_TICKS:
            raise UserError(f"unknown --fused-ticks {fused_ticks!r}: choose auto, on or off")
        if split_head not in SPLIT_HEAD:
            raise UserError(f"unknown --split-head {split_head!r}: choose on or off")
        values = {"stage_layers": _parse_counts(stage_layers) if stage_layers else None,
                  "virtual_stages": virtual_stages,
                  "remat_ratios": _parse_ratios(remat_ratios) if remat_ratios else None,
                  "backward_ticks": backward_ticks, "fused_ticks": FUSED_TICKS[fused_ticks],
                  "split_head": SPLIT_HEAD[split_head]}
        if pipeline is None:
            given = _per_stage_flags(values)
            if virtual_stages:
                given += (("--virtual-stages", str(virtual_stages)),)
            if given:
                raise UserError(f"{given[0][0]} {given[0][1]} needs --pipeline and a stage "
                                f"mesh axis")
            return None
        return cls(schedule=pipeline, **values)

    def per_stage_flags(self) -> tuple[tuple[str, str], ...]:
        """The tick executor's per-stage settings this config sets, as (flag, value) the way
        the command line spells them (`--stage-layers 5,6,6,7`); the defaults left out."""
        return _per_stage_flags({f.name: getattr(self, f.name)
                                 for f in dataclasses.fields(PipelineConfig)})

    def ratios_for(self, stages: int) -> tuple[Fraction, ...] | None:
        """The recompute ratio of each of S stages: Merak's rule from r0 for one value
        (`remat.stage_ratios`, shifted by a stage under a schedule that says so), else the
        values checked for one per stage; None without ratios."""
        if self.remat_ratios is None:
            return None
        if len(self.remat_ratios) == 1:
            shifted = registry.get(self.schedule).shifted_recompute
            return stage_ratios(stages, self.remat_ratios[0], shifted=shifted)
        return check_ratios(self.remat_ratios, stages)

    def to_json(self) -> dict:
        """The fields as JSON values (ratios as "k/n" text); `PipelineConfig(**d)` reads them."""
        return {**dataclasses.asdict(self),
                "stage_layers": None if self.stage_layers is None else list(self.stage_layers),
                "remat_ratios": None if self.remat_ratios is None
                else [str(r) for r in self.remat_ratios]}


def _per_stage_flags(values: Mapping[str, object]) -> tuple[tuple[str, str], ...]:
    fused = values["fused_ticks"]
    given = (("--stage-layers", values["stage_layers"] and ",".join(
                 map(str, values["stage_layers"]))),
             ("--remat-ratios", values["remat_ratios"] and ",".join(
                 map(ratio_text, values["remat_ratios"]))),
             ("--backward-ticks", values["backward_ticks"] and str(values["backward_ticks"])),
             ("--fused-ticks", None if fused is None else "on" if fused else "off"),
             ("--split-head", "on" if values["split_head"] else None))
    return tuple((flag, text) for flag, text in given if text)


def _parse_counts(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise UserError(f"stage layers {text!r} are not integers: give comma-separated counts, "
                        f"one per stage, e.g. --stage-layers 5,6,6,7") from None


def _parse_ratios(text: str) -> tuple[Fraction, ...]:
    return _ratios([p.strip() for p in text.split(",")])


def _counts(counts: Sequence[int]) -> tuple[int, ...]:
    if isinstance(counts, str):
        raise UserError(f"stage_layers={counts!r} is text: give a tuple of counts, e.g. "
                        f"(5, 6, 6, 7), or parse the flag's text with PipelineConfig.from_flags")
    text = ",".join(map(str, counts))
    if not counts or not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        raise UserError(f"stage layers ({text}) are not integers: give one count per stage, "
                        f"e.g. (5, 6, 6, 7) or --stage-layers 5,6,6,7")
    if min(counts) < 1:
        raise UserError(f"stage layers {text} leave a stage without layers: each stage needs "
                        f"at least one, e.g. --stage-layers 5,6,6,7")
    return tuple(counts)


def _ratios(ratios: Sequence[Ratio]) -> tuple[Fraction, ...]:
    if isinstance(ratios, str):
        raise UserError(f"remat_ratios={ratios!r} is text: give a tuple of ratios, e.g. "
                        f"(0.8,), or parse the flag's text with PipelineConfig.from_flags")
    if not ratios:
        raise UserError("remat ratios () give no ratio: give r0 (Merak's rule for the other "
                        "stages) or one per stage, or None for no stage-aware recompute")
    if len(ratios) == 1:
        return (exact_ratio(ratios[0], "first-stage recompute ratio r0"),)
    return tuple(exact_ratio(r, f"recompute ratio of stage {i}") for i, r in enumerate(ratios))
