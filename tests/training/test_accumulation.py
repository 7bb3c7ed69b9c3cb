"""Gradient accumulation: M micro-batches train exactly like one batch of M times the rows, and
the compiled step reduces gradients over the data axis once per step, after the micro-batch
loop, where parameters are not sharded over `data` (FSDP reduce-scatters per micro-batch)."""


import jax
import numpy as np
import pytest

from models import get_preset
from oases_jax.analysis import hlo
from oases_jax.mesh import make_mesh
from training import ParallelConfig, TrainConfig, train
from training.program import CompileSpec, lower

STEPS = 8
CASES = {  # name: (mesh, rules, schedule, micro-batches, data groups reduced once)
    "dp": ("data=8,tensor=1", "dp", "megatron", 2, True),
    "megatron": ("data=2,tensor=4", "tp", "megatron", 2, True),
    "oases": ("data=2,tensor=4", "tp", "oases", 2, True),
    "collective_matmul": ("data=2,tensor=4", "tp_sp", "collective_matmul", 2, True),
    "primepar": ("data=2,tp_row=2,tp_col=2", "primepar", "primepar", 2, False),
    "fsdp": ("data=8,tensor=1", "fsdp", "megatron", 2, False),
}


def _config(mesh: str, rules: str, schedule: str, microbatches: int = 1,
            batch_size: int = 16) -> TrainConfig:
    return TrainConfig(
        model=get_preset("tiny"),
        parallel=ParallelConfig(mesh=mesh, rules=rules, schedule=schedule),
        steps=STEPS, batch_size=batch_size, seq_len=32, microbatches=microbatches,
        log_every=STEPS, eval_every=STEPS, eval_batches=0, progress=False,
    )


@pytest.fixture(scope="module")
def one_batch():
    return train(_config("data=1,tensor=1", "dp", "megatron"), devices=jax.devices()[:1]).losses


@pytest.mark.parametrize("case", CASES)
def test_accumulated_steps_equal_one_batch(one_batch, case):
    mesh, rules, schedule, m, _ = CASES[case]
    losses = train(_config(mesh, rules, schedule, m)).losses
    np.testing.assert_allclose([losses[s] for s in one_batch], list(one_batch.values()),
                               rtol=1e-4)
    assert one_batch[STEPS] < one_batch[1]


def _data_reductions(module: hlo.HloModule, comp: hlo.Computation, data_of, n: int) -> int:
    """All-reduces and reduce-scatters in `comp` and what it calls whose groups span the data
    axis (devices with different data coordinates)."""
    count = 0
    for ins in comp.instrs:
        if ins.opcode.startswith(("all-reduce", "reduce-scatter")):
            groups = hlo.replica_groups(ins, n)
            count += any(len({data_of(d) for d in g}) > 1 for g in groups)
        for c in ins.called:
            if c in module.computations and c != comp.name:
                count += _data_reductions(module, module.computations[c], data_of, n)
    return count


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dp", "megatron", "oases", "fsdp"])
def test_data_reduction_once_per_step(case):
    """The micro-batch loop (the entry's outermost while) holds no reduction over `data`
    where the gradients accumulate in groups; after it the step reduces them."""
    mesh_text, rules, schedule, _, once = CASES[case]
    mesh = make_mesh(mesh_text, jax.devices())
    batch = 8 * mesh.shape["data"]  # 2 rows per device per micro-batch (2 sub-batches)
    cfg = _config(mesh_text, rules, schedule, 4, batch)
    spec = CompileSpec(model=cfg.model, parallel=cfg.parallel, batch_size=batch, seq_len=32,
                       microbatches=4)
    program = lower(spec, mesh)
    module = hlo.parse_module(program.compile().as_text())
    per_data = mesh.devices.size // mesh.shape["data"]

    def data_of(device: int) -> int:
        return device // per_data  # `data` is the mesh's leading axis

    entry = module.computations[module.entry]
    loops = [i for i in entry.instrs if i.opcode == "while" and module.trip_count(i) == 4]
    assert len(loops) == 1, [module.trip_count(i) for i in entry.instrs if i.opcode == "while"]
    body = module.computations[loops[0].attr("body").lstrip("%")]
    inside = _data_reductions(module, body, data_of, mesh.devices.size)
    total = _data_reductions(module, entry, data_of, mesh.devices.size)
    if once:
        assert inside == 0 and total - inside >= 1, (inside, total)
    else:  # FSDP: every micro-batch reduce-scatters its gradients
        assert inside >= 1, inside


def test_groups_follow_the_rules():
    from oases_jax.rules import get_rules
    from training.state import accumulation_groups

    mesh = make_mesh("data=2,tensor=4", jax.devices())
    assert accumulation_groups(get_rules("tp"), mesh) == 2
    assert accumulation_groups(get_rules("fsdp_tp"), mesh) == 1
    square = make_mesh("data=2,tp_row=2,tp_col=2", jax.devices())
    assert accumulation_groups(get_rules("primepar"), square) == 1
    assert accumulation_groups(get_rules("tp"), make_mesh("data=1,tensor=8", jax.devices())) == 1
