"""Layouts: how the devices and the global batch are split (data x fsdp x tensor, an MoE
model's data x expert x tensor, or primepar's data x q x q square, and accumulated
micro-batches), and the device ids of each group."""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass(frozen=True, kw_only=True)
class Layout:
    """How the devices and the batch are split: data x fsdp x tensor = devices, and the global
    batch into `microbatches` accumulated micro-batches of `global_batch / microbatches` rows.

    The built-in `fsdp` and `fsdp_tp` rule sets shard the parameters over every replica (the
    mesh's `data` axis), so a layout is either replicated (`fsdp == 1`) or fully sharded
    (`data == 1`, `fsdp` = all replicas); its mesh names the replica axis `data` either way.

    A `primepar` layout's tensor group is a q x q square (`tensor` = q^2, mesh axes `tp_row` and
    `tp_col`, rules `primepar`); its parameters are stacked with one sharding, so every layer of
    its plans runs `primepar` (`planner.cost.primepar_cost`).

    An MoE model's layout adds `expert` (EP: the experts split over it, the batch split over
    data x expert, as the runtime's rules do) between data and tensor; `expert_inner` says
    which of data and expert is the inner (closer, within a node) mesh axis: the mesh is
    data, expert, tensor, or expert, data, tensor (`planner.search.moe`)."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    microbatches: int = 1
    global_batch: int
    seq_len: int
    primepar: bool = False
    expert: int = 1
    expert_inner: bool = True

    def __post_init__(self):
        if self.fsdp > 1 and self.data > 1:
            raise ValueError(f"data={self.data} x fsdp={self.fsdp}: the fsdp rule sets shard "
                             "over all replicas; use data=1 with fsdp = the replica count")
        if self.primepar and (self.fsdp > 1 or self.square ** 2 != self.tensor
                              or self.square < 2):
            raise ValueError(f"a primepar layout needs tensor = q^2 with q >= 2 and no fsdp, "
                             f"got tensor={self.tensor}, fsdp={self.fsdp}")
        if self.expert > 1 and (self.fsdp > 1 or self.primepar):
            raise ValueError(f"expert={self.expert}: MoE layouts run under rules dp or tp, "
                             "without fsdp or primepar")

    @property
    def square(self) -> int:
        """q, the side of a primepar layout's square (1 otherwise)."""
        return math.isqrt(self.tensor) if self.primepar else 1

    @property
    def n_devices(self) -> int:
        return self.data * self.fsdp * self.expert * self.tensor

    @property
    def replicas(self) -> int:
        """The ways the batch is split: data x fsdp (x expert: EP splits the batch too)."""
        return self.data * self.fsdp * self.expert

    @property
    def rows(self) -> int:
        """Rows of one micro-batch on one device (before sub-batching)."""
        return self.global_batch // (self.replicas * self.microbatches)

    def stage_group(self, stages: int) -> list[int]:
        """Device ids of one `stage` group (stage is the outermost mesh axis)."""
        return [s * self.replicas * self.tensor for s in range(stages)]

    def mesh(self) -> dict[str, int]:
        """The training mesh: replicas on `data` (sharded or not, per `rules()`), then tensor
        (or primepar's square, `tp_row` x `tp_col`); with experts, data and expert in the
        layout's order, then tensor."""
        axes = {"data": self.replicas, "tensor": self.tensor}
        if self.expert > 1:
            outer = [("data", self.data), ("expert", self.expert)]
            axes = dict(outer if self.expert_inner else outer[::-1]) | {"tensor": self.tensor}
        if self.primepar:
            axes = {"data": self.replicas, "tp_row": self.square, "tp_col": self.square}
        return {k: v for k, v in axes.items() if v > 1} or {"data": 1}

    def rules(self) -> str:
        if self.primepar:
            return "primepar"
        if self.tensor > 1:
            return "fsdp_tp" if self.fsdp > 1 else "tp"
        return "fsdp" if self.fsdp > 1 else "dp"

    def label(self) -> str:
        mesh = ",".join(f"{k}={v}" for k, v in self.mesh().items())
        return (mesh + (" fsdp" if self.fsdp > 1 else "")
                + (f" x{self.microbatches}mb" if self.microbatches > 1 else ""))


# Groups. Tensor is the innermost (contiguous) mesh axis. On primepar's square, device (d, i, j)
# has id d q^2 + i q + j, so a column ring (tp_col) is q consecutive devices and a row ring
# (tp_row) q devices q apart.


def tensor_group(layout: Layout) -> list[int]:
    """Device ids of one tensor group: the innermost (contiguous) mesh axis."""
    return list(range(layout.tensor))


def replica_group(layout: Layout) -> list[int]:
    """Device ids of one data(+fsdp, +expert) group: strided by the tensor size."""
    return [i * layout.tensor for i in range(layout.replicas)]


def expert_group(layout: Layout) -> list[int]:
    """Device ids of one `expert` group: strided by tensor when expert is the inner axis, by
    tensor x data when it is the outer one."""
    stride = layout.tensor * (1 if layout.expert_inner else layout.data)
    return [i * stride for i in range(layout.expert)]


def data_group(layout: Layout) -> list[int]:
    """Device ids of one `data` group of an MoE layout (the devices holding the same experts'
    shards): strided by tensor x expert when expert is the inner axis, by tensor otherwise."""
    stride = layout.tensor * (layout.expert if layout.expert_inner else 1)
    return [i * stride for i in range(layout.data)]


def col_group(q: int) -> list[int]:
    """Device ids of one `tp_col` ring of a q x q square."""
    return list(range(q))


def row_group(q: int) -> list[int]:
    """Device ids of one `tp_row` ring of a q x q square."""
    return [i * q for i in range(q)]
