"""The HLO analysis on programs whose collectives are known by hand, on CPU and on `h100:8`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.hardware import get_cluster
from oases_jax.targets import get_target, has_gpu_aot
from oases_jax.tools.analysis.hlo import _iota_groups, _mesh_groups, parse_module
from oases_jax.tools.analysis.program import Program, analyze
from tests.hlo_programs import ppermute_ring_matmul as _ring

ROWS, COLS, OUT = 128, 256, 128  # per-device block sizes
TARGETS = ["local", pytest.param("h100:8", marks=pytest.mark.gpu_aot)]


@functools.cache
def _mesh(target: str, shape=(8,), names=("tensor",)) -> Mesh:
    if target != "local" and not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    devices = np.asarray(get_target(target).devices, dtype=object)
    return Mesh(devices.reshape(shape), names)


def _compile(f, mesh, *args):
    return analyze(jax.jit(f).lower(*args).compile(), mesh)[0]


def _arg(mesh, shape, spec, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


@pytest.mark.parametrize("target", TARGETS)
def test_blocking_all_reduce(target):
    mesh = _mesh(target, (2, 4), ("data", "tensor"))
    f = jax.shard_map(lambda x: jax.lax.psum(x, "tensor"), mesh=mesh,
                      in_specs=P("data", "tensor"), out_specs=P("data", None))
    a = _compile(f, mesh, _arg(mesh, (2 * ROWS, 4 * COLS), P("data", "tensor")))
    assert a.counts_by_kind() == {"all-reduce": 1}
    (c,) = a.collectives
    assert c.bytes == ROWS * COLS * 4 and c.group_size == 4 and c.axes == ("tensor",)
    assert not c.overlapped and a.overlap_share() == 0.0
    assert a.flops == 0


@pytest.mark.parametrize("target", TARGETS)
def test_ppermute_ring_in_a_loop(target):
    mesh = _mesh(target)
    f = jax.shard_map(_ring, mesh=mesh, in_specs=(P("tensor", None), P(None, "tensor")),
                      out_specs=P(None, "tensor"))
    a = _compile(f, mesh, _arg(mesh, (8 * ROWS, COLS), P("tensor", None), jnp.bfloat16),
                 _arg(mesh, (COLS, 8 * OUT), P(None, "tensor"), jnp.bfloat16))
    perms = [c for c in a.collectives if c.kind == "collective-permute"]
    assert len(perms) == 1 and perms[0].count == 8  # one op in the loop body, 8 trips
    (c,) = perms
    assert c.axes == ("tensor",) and c.group_size == 2
    assert c.groups == [[i, (i + 1) % 8] for i in range(8)]
    # XLA:CPU upcasts the bf16 operands of the dot to f32 before the loop, so its blocks are f32.
    assert c.bytes == ROWS * COLS * (4 if target == "local" else 2)
    assert a.flops == 8 * 2 * ROWS * COLS * OUT
    if target == "local":
        assert not c.is_async  # CPU collectives are synchronous
    else:
        assert c.is_async and c.gemm_overlapped
        assert a.overlap_share(require="gemm", kinds=["collective-permute"]) == 1.0


@pytest.mark.parametrize("target", TARGETS)
def test_all_gather_then_dot(target):
    mesh = _mesh(target)

    def f(x_blk, w):
        x = jax.lax.all_gather(x_blk, "tensor", tiled=True)
        return x @ w

    g = jax.shard_map(f, mesh=mesh, in_specs=(P("tensor", None), P()), out_specs=P(),
                      check_vma=False)
    a = _compile(g, mesh, _arg(mesh, (8 * ROWS, COLS), P("tensor", None)),
                 _arg(mesh, (COLS, OUT), P()))
    assert a.counts_by_kind() == {"all-gather": 1}
    (c,) = a.collectives
    assert c.bytes == 8 * ROWS * COLS * 4 and c.axes == ("tensor",) and c.group_size == 8
    assert not c.gemm_overlapped  # the dot needs the gathered x: nothing to overlap with
    assert a.flops == 2 * 8 * ROWS * COLS * OUT
    assert a.peak_memory_bytes >= 8 * ROWS * COLS * 4


def test_replica_group_formats():
    assert _iota_groups("[2,4]<=[8]") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _iota_groups("[4,2]<=[2,4]T(1,0)") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _mesh_groups("mesh['data'=2,'tensor'=4] {'data'}") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _mesh_groups("mesh['data'=2,'tensor'=4] {'tensor'}") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    p = Program("HloModule m\nENTRY %e () -> f32[] {\n  ROOT %c = f32[] constant(0)\n}\n",
                (("data", 2), ("tensor", 4)))
    assert p.axes_of([[0, 4], [1, 5]]) == ("data",)
    assert p.axes_of([[0, 1, 2, 3]]) == ("tensor",)
    assert p.axes_of([[0, 5]]) == ("data", "tensor")


def test_parser_reads_tuples_nested_calls_and_trip_counts():
    text = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%next, %x)
}

%cond (p.1: (s32[], f32[4,8])) -> pred[] {
  %p.1 = (s32[], f32[4,8]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(5)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8]{1,0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4,8]{1,0}) tuple(%zero, %a)
  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4,8]{1,0} get-tuple-element(%w), index=1
}
"""
    m = parse_module(text)
    assert m.entry == "main" and set(m.computations) == {"body", "cond", "main"}
    w = m.computations["main"].by_name["w"]
    assert w.called == ["body", "cond"] or sorted(w.called) == ["body", "cond"]
    assert m.trip_count(w) == 5
    assert w.result_bytes == 4 + 4 * 8 * 4


def test_parser_ends_computations_on_another_execution_thread():
    """XLA's multi-streamed windowed einsum puts computations on a second thread; their closing
    brace carries the thread, and the computation after one must still be read as its own."""
    text = """HloModule m

%gemm (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  ROOT %d = f32[4,2]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}, execution_thread="parallel"

ENTRY %main (a: f32[4,8], b: f32[8,2]) -> f32[4,2] {
  %a = f32[4,8]{1,0} parameter(0)
  %b = f32[8,2]{1,0} parameter(1)
  ROOT %c = f32[4,2]{1,0} call(%a, %b), to_apply=%gemm
}
"""
    m = parse_module(text)
    assert set(m.computations) == {"gemm", "main"} and m.entry == "main"
    assert [i.name for i in m.computations["gemm"].instrs] == ["a", "b", "d"]


def test_attribute_values_in_every_replica_group_form():
    text = """HloModule m

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %x = f32[8]{0} all-reduce(%a), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0), to_apply=%s
  %y = f32[8]{0} all-reduce(%x), channel_id=2, replica_groups={{0,1},{2,3}}, to_apply=%s
  ROOT %z = f32[8]{0} all-reduce(%y), replica_groups=mesh['data'=2,'tensor'=4] {'tensor'}, x=1
}
"""
    p = Program(text, (("data", 2), ("tensor", 4)))
    x, y, z = p.collectives()
    assert x.groups == [[0, 2, 4, 6], [1, 3, 5, 7]] and x.axes == ("data", "tensor")
    assert y.groups == [[0, 1], [2, 3]] and y.axes == ("tensor",)
    assert z.groups == [[0, 1, 2, 3], [4, 5, 6, 7]] and z.axes == ("tensor",)


def test_generic_async_wrapper_is_a_collective_with_a_window():
    text = """HloModule m

%wrapped_rs (p: f32[8,4]) -> f32[2,4] {
  %p = f32[8,4]{1,0} parameter(0)
  ROOT %rs = f32[2,4]{1,0} reduce-scatter(%p), replica_groups={{0,1,2,3}}, dimensions={0}
}

ENTRY %main (a: f32[8,4], b: f32[4,4]) -> (f32[2,4], f32[8,4]) {
  %a = f32[8,4]{1,0} parameter(0)
  %b = f32[4,4]{1,0} parameter(1)
  %start = ((f32[8,4]{1,0}), f32[2,4]{1,0}) async-start(%a), calls=%wrapped_rs
  %d = f32[8,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %done = f32[2,4]{1,0} async-done(%start)
  ROOT %t = (f32[2,4]{1,0}, f32[8,4]{1,0}) tuple(%done, %d)
}
"""
    p = Program(text, (("tensor", 4),))
    (c,) = p.collectives()
    assert c.kind == "reduce-scatter" and c.bytes == 8 * 4 * 4 and c.group_size == 4
    assert c.is_async and c.gemm_overlapped and c.window == ["d"]
    assert p.flops_of("main") == 2 * 8 * 4 * 4


@pytest.mark.gpu_aot
def test_multi_node_targets():
    if not has_gpu_aot():
        pytest.skip("needs the gpu-aot extra")
    t = get_target("h100:16")
    assert len(t.devices) == 16 and t.cluster.devices_per_node == 8
    assert t.cluster.link_for([0, 8]).name == "ib-400g"
    assert len(get_target("a100:64").devices) == 64
    assert get_target("h200:8").devices[0].device_kind == "NVIDIA H200"
    rtx = get_target("3090:32")  # the Oases clusters' GPU, over PCIe between its nodes of 8
    assert rtx.devices[0].device_kind == "NVIDIA GeForce RTX 3090"
    assert rtx.cluster.device_spec.memory_bytes == 24 * 2**30
    assert rtx.cluster.link_for([0, 1]).name == get_cluster("3090-pcie-32").link_for([0, 1]).name
