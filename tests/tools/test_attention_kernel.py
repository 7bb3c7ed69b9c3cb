"""The attention a compiled program holds: cuDNN's fused flash kernel for GPU meshes, real or
deviceless (`attention=auto`), materialised scores on CPU meshes; and the fused kernel priced
from its shapes in FLOPs, simulated time and XLA's estimate."""

import math

import jax
import numpy as np
import pytest

from oases_jax.errors import UserError
from oases_jax.models.config import ModelConfig
from oases_jax.models.layers import attention_impl
from oases_jax.models.presets import get_preset
from oases_jax.pipeline.config import PipelineConfig
from oases_jax.rules import get_rules, use_rules
from oases_jax.targets import cudnn_missing, get_target, has_gpu_aot
from oases_jax.tools.analysis.attention import fused_attention_flops, is_backward
from oases_jax.tools.analysis.simulate import roofline_time
from oases_jax.tools.inspection import inspect_program
from oases_jax.tools.report import summary
from oases_jax.training.config import ParallelConfig
from oases_jax.training.program import CompileSpec


def gpu_aot(test):
    return pytest.mark.gpu_aot(
        pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")(test))


# Llama-2 7B's shape at sequence 2048 on h100:8 as data=2 x tensor=4, two layers: per device
# B = 8 / 2 sequences, H = 32 / 4 heads, head dim K = 128.
LLAMA_B, LLAMA_H, L, K, LAYERS = 4, 8, 2048, 128, 2


def _mesh(devices, shape=(2, 4)):
    return jax.sharding.Mesh(np.array(devices[: math.prod(shape)]).reshape(shape),
                             ("data", "tensor"))


def _bf16(name: str) -> ModelConfig:
    return get_preset(name).replace(dtype="bfloat16")


# Which kernel `auto` resolves to, from the mesh being traced for.


def test_auto_on_a_cpu_mesh_is_xla_and_cudnn_there_names_the_fix():
    cfg = _bf16("tiny-llama")
    with use_rules(get_rules("tp"), _mesh(jax.devices())):
        assert attention_impl(cfg) == "xla"
        with pytest.raises(UserError, match="GPU backend.*devices are cpu.*attention=auto") as e:
            attention_impl(cfg.replace(attention="cudnn"))
    assert "\n" not in str(e.value)


@gpu_aot
def test_auto_on_a_deviceless_gpu_mesh_is_cudnn(monkeypatch):
    cfg, mesh = _bf16("tiny-llama"), _mesh(get_target("h100:8").devices)
    with use_rules(get_rules("tp"), mesh):
        if cudnn_missing() is None:
            assert attention_impl(cfg) == "cudnn"
        assert attention_impl(cfg.replace(dtype="float32")) == "xla"  # cuDNN's kernel is bf16
        assert attention_impl(cfg.replace(attention="xla")) == "xla"
    # Outside the rules (a shard_map region suspends them) jax's abstract mesh tells the same.
    monkeypatch.setattr("oases_jax.models.layers.cudnn_missing", lambda: None)
    seen = []
    with jax.set_mesh(mesh):
        jax.jit(lambda: seen.append(attention_impl(cfg))).trace()
    assert seen == ["cudnn"]


@gpu_aot
def test_without_the_cudnn_wheel_auto_falls_back_with_a_warning(monkeypatch):
    monkeypatch.setattr("oases_jax.models.layers.cudnn_missing", lambda: "cuDNN not found.")
    cfg = _bf16("tiny-llama")
    with use_rules(get_rules("tp"), _mesh(get_target("h100:8").devices)):
        with pytest.warns(UserWarning, match="uses xla.*cuDNN not found"):
            assert attention_impl(cfg) == "xla"
        with pytest.raises(UserError, match="attention=cudnn cannot be traced"):
            attention_impl(cfg.replace(attention="cudnn"))


# Compiled programs.


@pytest.fixture(scope="module")
def cpu_tiny():
    spec = CompileSpec(model=_bf16("tiny-llama"), batch_size=8, seq_len=128,
                       parallel=ParallelConfig(mesh="data=2,tensor=4"))
    return inspect_program(spec, get_target("local"))


def test_auto_on_the_cpu_mesh_still_materialises(cpu_tiny):
    report = cpu_tiny.report()
    assert report["attention_kernel"] == "materialised"
    assert not list(cpu_tiny.program.fused_attention_calls())
    assert "attention: materialised" in summary(report)


@gpu_aot
def test_accumulation_over_data_groups_compiles_cudnn_in_its_own_shard_map():
    """Micro-batches accumulated per data group (`training.state._accumulate_in_groups`, a
    shard_map manual over `data`) with GSPMD layers: jax's partitioning rule for cuDNN's kernel
    fails on the manual axis (`'GSPMDSharding' object has no attribute 'spec'`), so the kernel
    runs in a shard_map of its own over `tensor`: it compiles, with cuDNN's calls on this
    device's heads."""
    if cudnn_missing() is not None:
        pytest.skip("needs NVIDIA's cuDNN wheel")
    cfg = _bf16("tiny-llama")
    spec = CompileSpec(model=cfg, batch_size=8, seq_len=128, microbatches=2,
                       parallel=ParallelConfig(mesh="data=2,tensor=4"))
    ins = inspect_program(spec, get_target("h100:8"))
    assert ins.report()["attention_kernel"] == "cudnn_flash"
    calls = list(ins.program.fused_attention_calls())
    assert calls
    for _, instr, _ in calls:  # one device's [B, H, L, K]: 8 rows / 2 groups / 2, its heads
        if not is_backward(instr):
            assert instr.shapes[0].dims == (2, cfg.n_heads // 4, 128, cfg.k_dim), instr.name


@gpu_aot
@pytest.mark.parametrize("pipeline", ["1f1b", "gpipe_spmd"])
def test_pipelined_gpu_programs_compile_with_cudnn(pipeline):
    """A pipeline's stages run inside a shard_map manual over `stage`: the same failure, the same
    remedy, so pipelined GPU programs no longer need `attention=xla`."""
    if cudnn_missing() is not None:
        pytest.skip("needs NVIDIA's cuDNN wheel")
    cfg = _bf16("tiny-llama")
    spec = CompileSpec(model=cfg, batch_size=8, seq_len=128, microbatches=4,
                       parallel=ParallelConfig(mesh="stage=2,tensor=4",
                                               pipeline=PipelineConfig(schedule=pipeline)))
    ins = inspect_program(spec, get_target("h100:8"))
    assert ins.report()["attention_kernel"] == "cudnn_flash"
    assert list(ins.program.fused_attention_calls())


@pytest.fixture(scope="module")
def llama_7b():
    if not has_gpu_aot() or cudnn_missing() is not None:
        pytest.skip("needs the gpu-aot extra with NVIDIA's cuDNN wheel")
    model = get_preset("llama2-7b").replace(dtype="bfloat16", n_layers=LAYERS)
    spec = CompileSpec(model=model, batch_size=8, seq_len=L,
                       parallel=ParallelConfig(mesh="data=2,tensor=4"))
    return inspect_program(spec, get_target("h100:8"))


@pytest.mark.slow
@pytest.mark.gpu_aot
def test_llama_7b_on_h100s_holds_cudnn_flash_and_no_scores(llama_7b):
    ins = llama_7b
    calls = list(ins.program.fused_attention_calls())
    assert sorted((is_backward(i), n) for _, i, n in calls) == [(False, LAYERS), (True, LAYERS)]
    assert ins.report()["attention_kernel"] == "cudnn_flash"
    scores = LLAMA_B * LLAMA_H * L * L
    for comp in ins.program.module.computations.values():
        for instr in comp.instrs:
            for a in instr.shapes:
                assert a.dims.count(L) < 2 and math.prod(a.dims) != scores, (instr.name, a)
    assert "attention: cudnn_flash" in summary(ins.report())


@pytest.mark.gpu_aot
def test_llama_7b_attention_flops_and_time_follow_the_flash_formula(llama_7b):
    ins, device = llama_7b, llama_7b.target.cluster.device_spec
    calls = list(ins.program.fused_attention_calls())
    flops = sum(fused_attention_flops(i, c) * n for c, i, n in calls)
    seconds = sum(roofline_time(ins.program, c, i, device) * n for c, i, n in calls)
    # causal flash attention per layer: forward 2·B·H·L²·K, backward 2.5x that
    formula = LAYERS * 7 * LLAMA_B * LLAMA_H * L * L * K
    assert flops == pytest.approx(formula, rel=0.1)
    assert seconds == pytest.approx(formula / device.peak("bfloat16"), rel=0.1)
    # XLA's estimate carries the same price for the calls in place of its flat 10 us each
    attn = ins.xla.fused_attention
    assert attn["calls"] == 2 * LAYERS
    assert attn["xla_s"] == pytest.approx(2 * LAYERS * 10e-6, rel=0.05)
    assert attn["priced_s"] == pytest.approx(seconds, rel=1e-6)
    assert "fused-attention calls at the roofline price" in summary(ins.report())
