"""MoE models: presets, the sharded model equals the one-device model (loss, router losses and
every gradient), scan == unrolled, remat == no remat, and bad MoE input is one line, exit 2."""

import jax
import numpy as np
import pytest
from flax import nnx

from oases_jax.errors import UserError
from oases_jax.layer_plan import LayerSpec
from oases_jax.mesh import make_mesh
from oases_jax.models import get_preset
from oases_jax.models.presets import PRESETS
from oases_jax.models.sharding import abstract_model, init_sharded
from oases_jax.models.transformer import Transformer, objective
from oases_jax.moe import MoESetup
from oases_jax.moe.cost import choose_for_mesh
from oases_jax.rules import get_rules
from oases_jax.stacks import Parallel, use_parallel
from tests.scriptrun import run_script

pytestmark = pytest.mark.slow  # CI runs it (`make test MARK=...`)

MOE_PRESETS = [n for n in PRESETS if get_preset(n).moe]


def _tokens(b=8, length=16):
    return jax.random.randint(jax.random.key(1), (b, length + 1), 0, 256)


def _one_device(cfg):
    model = Transformer(cfg, rngs=nnx.Rngs(params=jax.random.key(0)))
    graphdef, params = nnx.split(model)
    f = jax.value_and_grad(lambda p, t: objective(nnx.merge(graphdef, p), t), has_aux=True)
    return jax.jit(f)(params, _tokens())


def _sharded(cfg, mesh_text, moe_schedule, schedule="megatron", rules="tp", chunks=2):
    mesh, rule_set = make_mesh(mesh_text), get_rules(rules)
    graphdef, params = nnx.split(init_sharded(cfg, rule_set, mesh, 0))
    parallel = Parallel(mesh, rule_set, LayerSpec(schedule=schedule),
                        moe=MoESetup(schedule=moe_schedule, chunks=chunks,
                                     choose=choose_for_mesh))

    def f(p, t):
        with use_parallel(parallel):
            return objective(nnx.merge(graphdef, p), t)

    with jax.set_mesh(mesh):
        return jax.jit(jax.value_and_grad(f, has_aux=True))(params, _tokens())


def _close(a, b, rel=1e-5, floor=1e-30, what=""):
    a, b = np.asarray(a), np.asarray(b)
    scale = max(float(np.max(np.abs(b))), floor)
    err = float(np.max(np.abs(a - b)))
    assert err <= rel * scale, (what, err, scale)


def _assert_same(got, want, rel=1e-5):
    (loss, parts), grads = got
    (loss_ref, parts_ref), grads_ref = want
    _close(loss, loss_ref, rel)
    assert set(parts) == {"ce_loss", "aux_loss", "z_loss", "dropped_frac"}
    for k in parts:
        _close(parts[k], parts_ref[k], rel)
    flat, flat_ref = (jax.tree_util.tree_leaves_with_path(g) for g in (grads, grads_ref))
    # A gradient that is zero by analysis (the key bias: softmax ignores a constant shift) is
    # rounding noise of 1e-11 on either side: relative to 1e-4 of the largest gradient.
    floor = 1e-4 * max(float(np.max(np.abs(b))) for _, b in flat_ref)
    for (path, a), (_, b) in zip(flat, flat_ref, strict=True):
        assert a.shape == b.shape, path
        _close(a, b, rel, floor, jax.tree_util.keystr(path))


@pytest.fixture(scope="module", params=["gpt2", "llama"])
def family(request):
    # tiny-moe's capacity factor E/k = 2 gives every expert a slot for every token: no drops.
    cfg = get_preset("tiny-moe").replace(family=request.param, n_heads=8, n_kv_heads=4,
                                         head_dim=8)
    return cfg, _one_device(cfg)


@pytest.mark.parametrize("mesh_text, moe_schedule", [
    ("data=2,expert=2,tensor=2", "ds_moe"), ("data=2,expert=2,tensor=2", "parm_s1"),
    ("data=2,expert=2,tensor=2", "parm_s2"), ("expert=2,tensor=4", "auto"),
    ("expert=4,tensor=2", "parm_s2"), ("data=2,tensor=4", "auto"),
])
def test_sharded_model_equals_one_device(family, mesh_text, moe_schedule):
    cfg, want = family
    got = _sharded(cfg, mesh_text, moe_schedule)
    assert float(want[0][1]["dropped_frac"]) == 0.0
    _assert_same(got, want)


def test_sequence_parallel_attention_with_s1(family):
    # megatron_sp: the attention output is reduce-scattered over tokens and S1 gates those
    # (the RS variant of "pause MP").
    cfg, want = family
    _assert_same(_sharded(cfg, "data=2,expert=2,tensor=2", "parm_s1", "megatron_sp", "tp_sp"),
                 want)


def test_scan_and_remat_change_nothing():
    cfg = get_preset("tiny-moe").replace(n_layers=4)
    want = _one_device(cfg)
    _assert_same(_one_device(cfg.replace(scan_layers=False)), want, 1e-6)
    _assert_same(_one_device(cfg.replace(remat="full")), want, 1e-6)


def test_loss_adds_weighted_router_losses():
    cfg = get_preset("tiny-moe").replace(router_aux_weight=0.5, router_z_weight=0.25)
    (loss, parts), _ = _one_device(cfg)
    n = cfg.n_moe_layers
    want = parts["ce_loss"] + n * (0.5 * parts["aux_loss"] + 0.25 * parts["z_loss"])
    _close(loss, want, 1e-6)
    (loss0, parts0), _ = _one_device(cfg.replace(router_aux_weight=0.0, router_z_weight=0.0))
    _close(loss0, parts0["ce_loss"], 1e-7)


@pytest.mark.parametrize("name", MOE_PRESETS)
def test_moe_presets_build(name):
    cfg = get_preset(name)
    _, state = abstract_model(cfg)
    n = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(state))
    assert n == cfg.param_count()


def test_published_sizes():
    # Mixtral 8x7B: 46.7B parameters, 12.9B active; OLMoE 6.9B / 1.3B; Qwen3-30B-A3B 30.5B / 3.3B.
    for name, total, active in (("mixtral-8x7b", 46.70e9, 12.88e9), ("olmoe-1b-7b", 6.92e9,
                                 1.28e9), ("qwen3-30b-a3b", 30.53e9, 3.35e9)):
        cfg = get_preset(name)
        assert abs(cfg.param_count() / total - 1) < 0.002, name
        assert abs(cfg.param_count(active=True) / active - 1) < 0.01, name


@pytest.mark.parametrize("overrides, needle", [
    ({"top_k": 5}, "top_k=5 is more than n_experts=4"),
    ({"capacity_factor": 0.0}, "capacity_factor=0.0 must be a positive"),
    ({"n_layers": 3}, "not a multiple of moe_every=2"),
    ({"router_aux_weight": -1.0}, "router_aux_weight=-1.0 must be a finite number >= 0"),
])
def test_bad_config_is_one_line(overrides, needle):
    with pytest.raises(UserError, match=needle) as e:
        get_preset("tiny-moe").replace(**overrides)
    assert "\n" not in str(e.value)


TINY = ("--no-progress", "--model", "tiny-moe", "--steps", "1", "--batch-size", "8",
        "--seq-len", "16", "--eval-batches", "0")


@pytest.mark.parametrize("args, needles", [
    (("--mesh", "expert=8", "--moe-schedule", "parm_s1"), ("n_experts=4", "expert=8")),
    (("--model-set", "top_k=6"), ("top_k=6", "n_experts=4")),
    (("--model-set", "capacity_factor=-1"), ("capacity_factor=-1.0",)),
    (("--mesh", "data=2,tensor=4", "--moe-schedule", "parm_s2"), ("needs an expert mesh axis",)),
    (("--moe-schedule", "s3"), ("s3", "parm_s1")),
    (("--mesh", "expert=2,tensor=4", "--rules", "fsdp"), ("--rules dp, tp or tp_sp",)),
])
def test_bad_moe_flags_are_one_line(tmp_path, args, needles):
    proc = run_script("train.py", *TINY, "--out-dir", str(tmp_path / "run"), *args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
