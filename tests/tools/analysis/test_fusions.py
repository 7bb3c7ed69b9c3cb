"""The per-op account of compute outside the GEMMs: categories from name scopes and op kinds,
calls from loop trip counts, bytes and roofline times by hand arithmetic."""

import jax
import jax.numpy as jnp
import pytest

from oases_jax.hardware import DeviceSpec
from oases_jax.tools.analysis import fusions
from oases_jax.tools.analysis.program import Program

N, D = 1024, 256  # an f32 [N, D] array is 1 MiB
MIB = 2**20


def _program(fn, *args) -> Program:
    return Program(jax.jit(fn).lower(*args).compile().as_text())


@pytest.fixture(scope="module")
def rows():
    def step(x, w, h):
        with jax.named_scope("norm"):
            y = x * 2.0 + 1.0  # one elementwise fusion: reads x, writes y

        def body(c, _):
            with jax.named_scope("activation"):
                return jnp.tanh(c) * 3.0, None

        z, _ = jax.lax.scan(body, y, None, length=4)  # 4 trips of one fusion
        g = z @ w  # a GEMM
        cast = h.astype(jnp.bfloat16)  # a conversion and nothing else
        return g, cast

    x = jnp.ones((N, D), jnp.float32)
    w = jnp.ones((D, D), jnp.float32)
    h = jnp.ones((N, D), jnp.float32)
    program = _program(step, x, w, h)
    device = DeviceSpec(name="test", match=(), peak_flops={"float32": 1e12, "bfloat16": 2e12},
                        hbm_bytes_per_s=1e12, memory_bytes=80e9)
    return fusions.account(program, device)


def _one(rows, category):
    found = [r for r in rows if r.category == category]
    assert found, [(r.name, r.category) for r in rows]
    return found


def test_categories_calls_and_bytes(rows):
    norm = _one(rows, "norm")
    assert sum(r.total_bytes for r in norm) == 2 * MIB  # read x, write y: 1 MiB each
    act = _one(rows, "activation")
    assert {r.calls for r in act} == {4}
    assert sum(r.bytes for r in act) == 2 * MIB  # per trip: read c, write the next c
    conv = _one(rows, "convert")
    assert max(r.total_bytes for r in conv) == MIB + MIB // 2  # f32 in, bf16 out
    gemm = _one(rows, "gemm")
    assert sum(r.calls * r.flops for r in gemm) == 2 * N * D * D


def test_roofline_seconds(rows):
    """Elementwise ops are bandwidth-bound: bytes / (1000 GB/s)."""
    for r in _one(rows, "norm"):
        assert r.seconds == pytest.approx(r.bytes / 1e12)


def test_summary_splits_gemm_from_the_rest(rows):
    s = fusions.summarize(rows, top=3)
    assert s["gemm"]["flops"] == 2 * N * D * D
    assert s["non_gemm"]["bytes"] == sum(r.total_bytes for r in rows if not r.gemm)
    assert set(s["non_gemm_by_category"]) >= {"norm", "activation", "convert"}
    assert len(s["top_non_gemm"]) == 3
    top = [r["total_s"] for r in s["top_non_gemm"]]
    assert top == sorted(top, reverse=True)
    text = fusions.format_summary(s)
    assert "activation" in text and "GEMMs" in text


def test_tuple_element_operands_count_their_element():
    """`%t#i` (how XLA prints a loop parameter's elements) reads element i of tuple t: a fusion
    converting element 1 (f32 [1024, 256], 1 MiB) reads 1 MiB, not the whole 49 MiB tuple."""
    text = """HloModule m, entry_computation_layout={()->bf16[1024,256]{1,0}}

%fused_convert (p0: f32[1024,256]) -> bf16[1024,256] {
  %p0 = f32[1024,256]{1,0} parameter(0)
  ROOT %c = bf16[1024,256]{1,0} convert(%p0)
}

ENTRY %main (t: (f32[48,1024,256], f32[1024,256])) -> bf16[1024,256] {
  %t = (f32[48,1024,256]{2,1,0}, f32[1024,256]{1,0}) parameter(0)
  ROOT %f = bf16[1024,256]{1,0} fusion(%t#1), kind=kLoop, calls=%fused_convert
}
"""
    program = Program(text)
    comp = program.comp(program.module.entry)
    f = comp.by_name["f"]
    assert f.operands == ["t"] and f.elements == (1,)
    assert program.traffic_bytes(comp, f) == MIB + MIB // 2
    assert comp.by_name["t"].element_bytes(0) == 48 * MIB


@pytest.mark.parametrize("read", [
    "dynamic-slice(%p0, %p2, %z, %z), dynamic_slice_sizes={1,1024,256}",
    "slice(%p0), slice={[1:2], [0:1024], [0:256]}"])
def test_accumulate_into_part_of_a_buffer_reads_that_part(read):
    """`acc.at[c].add(g)` compiles to a fusion that slices the accumulator (a dynamic slice, or a
    static one when c is known) and updates the same buffer in place: it reads the 1 MiB part
    and the 1 MiB update and writes the part (3 MiB), not the whole 2 MiB buffer besides (the
    tick executor's accumulate into one of two chunks)."""
    text = """HloModule m, entry_computation_layout={()->f32[2,1024,256]{2,1,0}}

%fused_acc (p0: f32[2,1024,256], p1: f32[1,1024,256], p2: s32[]) -> f32[2,1024,256] {
  %p0 = f32[2,1024,256]{2,1,0} parameter(0)
  %p1 = f32[1,1024,256]{2,1,0} parameter(1)
  %p2 = s32[] parameter(2)
  %z = s32[] constant(0)
  %old = f32[1,1024,256]{2,1,0} READ
  %new = f32[1,1024,256]{2,1,0} add(%old, %p1)
  ROOT %out = f32[2,1024,256]{2,1,0} dynamic-update-slice(%p0, %new, %p2, %z, %z)
}

ENTRY %main (acc: f32[2,1024,256], g: f32[1,1024,256], c: s32[]) -> f32[2,1024,256] {
  %acc = f32[2,1024,256]{2,1,0} parameter(0)
  %g = f32[1,1024,256]{2,1,0} parameter(1)
  %c = s32[] parameter(2)
  ROOT %f = f32[2,1024,256]{2,1,0} fusion(%acc, %g, %c), kind=kLoop, calls=%fused_acc
}
"""
    program = Program(text.replace("READ", read))
    comp = program.comp(program.module.entry)
    assert program.traffic_bytes(comp, comp.by_name["f"]) == 3 * MIB + 4
