"""What the stage partitioner works on and returns: per-layer costs and memory of one stage's
device (`StageInputs`) and a partition with its simulated step (`StagePlan`)."""

from __future__ import annotations

import dataclasses
from fractions import Fraction

from oases_jax.planner.prices import SharedCores
from oases_jax.planner.stage_sim import NO_ENDS, Ends, table_choice


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageInputs:
    """Per layer, one micro-batch, one device: forward `f`, backward `b` (no recompute), the
    recompute `r` a rematted layer adds, the activations kept per micro-batch in flight without
    (`act`) and with (`act_remat`) remat, and the backward's working set (`temp`,
    `temp_remat`). `block_bytes`: one layer's parameters, gradients and optimizer state (the
    stage layout pads every stage to the longest one's layer count). The embedding runs on the
    first stage (`first_f`, `first_b`), the head and loss on the last (`last_f`, `last_b`,
    `last_temp`); `shared_bytes` (embedding and head state) sits on every stage."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    r: tuple[float, ...]
    act: tuple[float, ...]
    act_remat: tuple[float, ...]
    temp: tuple[float, ...]
    temp_remat: tuple[float, ...]
    # What a layer's forward spends storing its residuals for the backward (inside `f`), and
    # what it saves of that when rematted (it stores only its input). Zero where nothing is
    # stored between ticks.
    store: tuple[float, ...] = ()
    store_save: tuple[float, ...] = ()
    block_bytes: float = 0.0
    shared_bytes: float = 0.0
    first_f: float = 0.0
    first_b: float = 0.0
    last_f: float = 0.0
    last_b: float = 0.0
    last_temp: float = 0.0
    # A split head (`--split-head on`): its phase on every device, once a micro-batch (the
    # ends' last_f and last_b are then 0); 0: the head is the last stage's.
    head_phase: float = 0.0
    # Devices that share a host's cores (CPU devices: `Hardware.shared_cores`), which the
    # simulator's ticks then price by processor sharing; None on GPUs.
    shared: SharedCores | None = None

    def __post_init__(self):
        n = len(self.f)
        for name in ("store", "store_save"):
            if not getattr(self, name):
                object.__setattr__(self, name, (0.0,) * n)

    @classmethod
    def uniform(cls, n_layers: int, *, f: float, b: float, r: float = 0.0, act: float = 0.0,
                act_remat: float = 0.0, temp: float = 0.0, temp_remat: float = 0.0,
                store: float = 0.0, store_save: float = 0.0, **ends: float) -> StageInputs:
        """`n_layers` identical layers."""
        n = n_layers
        return cls(f=(f,) * n, b=(b,) * n, r=(r,) * n, act=(act,) * n,
                   act_remat=(act_remat,) * n, temp=(temp,) * n, temp_remat=(temp_remat,) * n,
                   store=(store,) * n, store_save=(store_save,) * n, **ends)

    @property
    def n_layers(self) -> int:
        return len(self.f)

    @property
    def ends(self) -> Ends:
        """(first_f, first_b, last_f, last_b): what the embedding and the head add to the end
        stages, on one chunk each (`stage_sim.chunk_costs`)."""
        return (self.first_f, self.first_b, self.last_f, self.last_b)


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """A partition: layers and recomputed layers (its first ones) per stage, each stage's time
    of one micro-batch (f, b, r) and memory, and the simulated step. `exact`: the branch and
    bound proved the step the least over all partitions (else a local optimum)."""

    schedule: str
    microbatches: int
    chunks: int
    layers: tuple[int, ...]
    remat: tuple[int, ...]
    f: tuple[float, ...]
    b: tuple[float, ...]
    r: tuple[float, ...]
    memory: tuple[float, ...]
    makespan: float
    finish: tuple[float, ...]  # per stage: when its last action ends
    exact: bool
    p2p: float = 0.0  # the stage-to-stage transfer time the step was simulated with
    ends: Ends = NO_ENDS  # the embedding's and head's f, b inside the end stages' (`simulate`)
    head_phase: float = 0.0  # a split head's phase a micro-batch on every stage (`StageInputs`)

    @property
    def split_head(self) -> bool:
        return self.head_phase > 0

    @property
    def stages(self) -> int:
        return len(self.layers)

    @property
    def loads(self) -> tuple[float, ...]:
        return tuple(f + b + r + self.head_phase
                     for f, b, r in zip(self.f, self.b, self.r, strict=True))

    @property
    def balance(self) -> float:
        """max stage load / mean stage load (1 is perfect balance)."""
        loads = self.loads
        return max(loads) / (sum(loads) / len(loads))

    @property
    def tick_table(self) -> tuple[int, bool]:
        """(ticks each backward spans, fused table) of the program this plan runs: the choice
        its step was simulated with (`stage_sim.table_choice`); the plan records both."""
        return table_choice(self.schedule, self.microbatches, self.chunks, self.f, self.b,
                            self.r, self.p2p, self.ends, self.head_phase)

    @property
    def backward_ticks(self) -> int:
        return self.tick_table[0]

    @property
    def fused_ticks(self) -> bool:
        return self.tick_table[1]

    @property
    def ratios(self) -> tuple[Fraction, ...]:
        """Per-stage recompute ratios k_i / n_i, exact (floor(n_i r_i) = k_i at run time)."""
        return tuple(Fraction(k, n) for k, n in zip(self.remat, self.layers, strict=True))
