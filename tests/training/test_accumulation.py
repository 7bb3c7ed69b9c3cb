"""Gradient accumulation: M micro-batches train exactly like one batch of M times the rows, and
the compiled step reduces gradients over the data axis once per step, after the micro-batch
loop, where parameters are not sharded over `data` (FSDP reduce-scatters per micro-batch)."""


import jax
import numpy as np
import pytest

from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.tools.analysis import hlo
from oases_jax.training import ParallelConfig, TrainConfig, train
from oases_jax.training.program import CompileSpec, lower

STEPS = 8
CASES = {  # name: (mesh, rules, schedule, micro-batches, data groups reduced once)
    "dp": ("data=8,tensor=1", "dp", "megatron", 2, True),
    "megatron": ("data=2,tensor=4", "tp", "megatron", 2, True),
    "oases": ("data=2,tensor=4", "tp", "oases", 2, True),
    "collective_matmul": ("data=2,tensor=4", "tp_sp", "collective_matmul", 2, True),
    "primepar": ("data=2,tp_row=2,tp_col=2", "primepar", "primepar", 2, True),
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
@pytest.mark.parametrize("case", ["dp", "megatron", "oases", "fsdp", "primepar"])
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
    from oases_jax.training.state import accumulation_groups

    mesh = make_mesh("data=2,tensor=4", jax.devices())
    assert accumulation_groups(get_rules("tp"), mesh) == 2
    assert accumulation_groups(get_rules("fsdp_tp"), mesh) == 1
    square = make_mesh("data=2,tp_row=2,tp_col=2", jax.devices())
    assert accumulation_groups(get_rules("primepar"), square) == 2  # (data, tp_row): data off
    assert accumulation_groups(get_rules("tp"), make_mesh("data=1,tensor=8", jax.devices())) == 1


@pytest.fixture(scope="module")
def bf16_model():
    import jax.numpy as jnp  # noqa: F401
    from flax import nnx

    from oases_jax.models.sharding import init_sharded
    from oases_jax.rules import get_rules

    cfg = get_preset("tiny").replace(dtype="bfloat16", n_layers=3)
    one = make_mesh("data=1", jax.devices()[:1])
    graphdef, params = nnx.split(init_sharded(cfg, get_rules("dp"), one, 0))
    tokens = jax.random.randint(jax.random.key(3), (4, 2, 17), 0, cfg.vocab_size)
    return cfg, graphdef, params, tokens


def test_weights_cast_once_give_the_per_micro_batch_gradients(bf16_model):
    """bf16 compute: `accumulate` casts the block weights once, before the micro-batch loop.
    Its sums equal those of value_and_grad on the float32 weights micro-batch by micro-batch
    (the model casting at each use, as before), float32 gradients included."""
    import jax.numpy as jnp

    from oases_jax.training.state import accumulate, loss_fn

    cfg, graphdef, params, tokens = bf16_model

    def grad_fn(p, t):
        (loss, _), g = jax.value_and_grad(
            lambda p, t: loss_fn(graphdef, p, t, cfg.vocab_size), has_aux=True)(p, t)
        return {"loss": loss}, g

    zeros = {"loss": jnp.zeros((), jnp.float32)}
    got_m, got_g = jax.jit(lambda p, t: accumulate(grad_fn, p, t, zeros, cfg.dtype))(
        params, tokens)
    per = [jax.jit(grad_fn)(params, t) for t in tokens]
    want_m = sum(float(m["loss"]) for m, _ in per)
    want_g = jax.tree.map(lambda *gs: sum(np.asarray(g, np.float64) for g in gs),
                          *[g for _, g in per])
    np.testing.assert_allclose(float(got_m["loss"]), want_m, rtol=1e-6)
    cast = 0
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got_g), jax.tree.leaves(want_g),
                            strict=True):
        assert a.dtype == jnp.float32, jax.tree_util.keystr(path)
        cast += a.ndim >= 3
        np.testing.assert_allclose(np.asarray(a, np.float64), b, rtol=0,
                                   atol=1e-6 * max(np.abs(b).max(), 1e-30),
                                   err_msg=jax.tree_util.keystr(path))
    assert cast >= 4  # the stacked block matrices went through the one cast


@pytest.mark.parametrize("target", ["cpu", pytest.param("h100:1", marks=pytest.mark.gpu_aot)])
def test_no_weight_cast_inside_the_micro_batch_loop(target):
    """The compiled bf16 step with M=4: the micro-batch loop's body converts no float32 weight
    stack to bf16 (one convert of each before the loop). On the CPU XLA hoists a per-micro-batch
    cast out of the loop itself; for a GPU it did not (4 casts a step on h100:1 before)."""
    import re

    from oases_jax.targets import get_target, has_gpu_aot

    if target != "cpu" and not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    cfg = get_preset("tiny").replace(dtype="bfloat16", n_layers=3)
    devices = jax.devices()[:1] if target == "cpu" else get_target(target).devices
    mesh = make_mesh("data=1", devices)
    spec = CompileSpec(model=cfg, parallel=ParallelConfig(mesh="data=1", rules="dp"),
                       batch_size=8, seq_len=32, microbatches=4)
    module = hlo.parse_module(lower(spec, mesh).compile().as_text())
    def reach(comp, seen):
        if comp.name not in seen:
            seen.add(comp.name)
            yield comp
            for i in comp.instrs:
                for c in i.called:
                    if c in module.computations:
                        yield from reach(module.computations[c], seen)

    def casts(comp, skip=frozenset()) -> int:
        """Converts of a float32 [3, a, b] weight stack to bf16 in `comp` and what it calls."""
        n = 0
        for c in reach(comp, set(skip)):
            for i in c.instrs:
                if i.opcode == "convert" and re.match(r"bf16\[3,\d+,\d+\]", i.type_text):
                    src = c.by_name.get(i.operands[0])
                    n += bool(src and src.type_text.startswith("f32[3,"))
        return n

    entry = module.computations[module.entry]
    (loop,) = [i for i in entry.instrs if i.opcode == "while" and module.trip_count(i) == 4]
    body = module.computations[loop.attr("body").lstrip("%")]
    assert casts(body) == 0
    assert casts(entry, skip={body.name}) >= 4


def test_fused_attention_inside_data_groups_runs_in_its_own_shard_map(one_batch, monkeypatch):
    """Accumulating in data groups puts the layers inside a shard_map manual over `data`, where
    jax cannot partition cuDNN's fused attention; the kernel then runs in a shard_map of its own
    over the remaining axes (`models.layers._cudnn_attention`). cuDNN needs a GPU, so here the
    kernel's place is taken by jax's XLA implementation of the same call, through the same
    shard_map: the losses equal one batch on one device."""
    import oases_jax.models.layers as layers

    real = jax.nn.dot_product_attention
    calls = []

    def kernel(q, k, v, *, is_causal, implementation):
        assert implementation == "cudnn"
        calls.append(q.shape)
        return real(q, k, v, is_causal=is_causal, implementation="xla")

    monkeypatch.setattr(layers, "attention_impl", lambda cfg: "cudnn")
    monkeypatch.setattr(jax.nn, "dot_product_attention", kernel)
    losses = train(_config("data=2,tensor=4", "tp", "megatron", 2)).losses
    np.testing.assert_allclose([losses[s] for s in one_batch], list(one_batch.values()),
                               rtol=1e-4)
    heads = get_preset("tiny").n_heads
    assert calls and all(shape[2] == heads // 4 for shape in calls)  # this device's heads
