"""The MoE cost model: byte counts by hand arithmetic and against the compiled CPU programs,
S1's de-duplication read from the HLO (no activation all-reduce, the gate sees T/mp rows), and
the S1/S2 choice at its crossover."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from oases_jax.analysis import moe_cost as cost
from oases_jax.analysis.hardware import DEVICES, LinkSpec
from oases_jax.analysis.program import analyze
from oases_jax.analysis.simulate import collective_time
from oases_jax.mesh import make_mesh
from oases_jax.moe import MoEArgs, MoESetup, moe_layer, use_moe
from oases_jax.rules import get_rules

NAMES = {"w_in": ("expert", "embed", "mlp"), "w_out": ("expert", "mlp", "embed")}


def _shape(**kw):
    base = dict(tokens=64, d_model=16, d_ff=32, experts=8, top_k=2, capacity_factor=1.0,
                dtype_bytes=4, ep=2, mp=4)
    return cost.LayerShape(**{**base, **kw})


def test_bytes_by_hand():
    s = _shape()
    # S1: T/mp = 16 tokens per device, C = ceil(1.0 * 2 * 16 / 8) = 4 slots per expert.
    assert cost.slots(s, "parm_s1") == 4
    got = {(c.kind, c.axis): (c.nbytes, c.count) for c in cost.collectives(s, "parm_s1")}
    assert got == {("all-to-all", "expert"): (8 * 4 * 16 * 4, 2),  # E C D b, there and back
                   ("all-gather", "tensor"): (64 * 16 * 4, 1),  # the restore: T D b
                   ("reduce-scatter", "tensor"): (4 * 8 * 4 * 16 * 4, 1)} | {
        ("all-gather", "tensor"): (64 * 16 * 4, 1)}
    kinds = [(c.kind, c.nbytes, c.count) for c in cost.collectives(s, "parm_s1")]
    assert ("all-gather", 4 * 2048, 1) in kinds and ("all-gather", 4096, 1) in kinds
    # ds_moe: all 64 tokens gated, C = ceil(2 * 64 / 8) = 16 (a multiple of mp), 16/4 kept.
    assert cost.slots(s, "ds_moe") == 4
    assert ("all-reduce", 64 * 16 * 4, 1) in [(c.kind, c.nbytes, c.count)
                                              for c in cost.collectives(s, "ds_moe")]
    # S2 with 3 chunks pads C = 4 to 6 slots: 3 chunks of 2.
    assert cost.slots(s, "parm_s2", 3) == 6
    a2a = next(c for c in cost.collectives(s, "parm_s2", 3) if c.kind == "all-to-all")
    assert (a2a.nbytes, a2a.count) == (8 * 2 * 16 * 4, 6)


def _hw(inter: LinkSpec, intra: LinkSpec, overlap=True, device=DEVICES["h100"]):
    return cost.MoEHardware(device=device, ep_link=inter, mp_link=intra,
                            same_level=inter == intra, overlap=overlap)


NVLINK = LinkSpec(name="nvlink", bytes_per_s=450e9, latency_s=3e-6)
IB = LinkSpec(name="ib", bytes_per_s=50e9, latency_s=8e-6)


def test_one_chunk_is_the_sum_of_its_stages():
    s = _shape(tokens=4096, d_model=1024, d_ff=4096, dtype_bytes=2)
    hw = _hw(IB, NVLINK)
    n = 8 * cost.slots(s, "parm_s1") * 1024 * 2
    comm = 2 * collective_time("all-to-all", n, 2, IB) + 2 * collective_time(
        "all-gather", 4 * n, 4, NVLINK)
    est = cost.estimate(s, hw, "parm_s1")
    restore = collective_time("all-gather", 4096 * 1024 * 2, 4, NVLINK)
    ffn_gate = est.forward_s - comm - restore
    assert 0 < ffn_gate < est.forward_s


def test_s2_wins_with_big_messages_on_two_link_levels_and_loses_otherwise():
    big = _shape(tokens=16384, d_model=2048, d_ff=8192, dtype_bytes=2, capacity_factor=2.0)
    small = _shape(tokens=256, d_model=768, d_ff=3072, dtype_bytes=2)
    assert cost.choose(big, _hw(IB, NVLINK)).schedule == "parm_s2"
    assert cost.choose(small, _hw(IB, NVLINK)).schedule == "parm_s1"
    # One link level: the chunks' collectives share it; with negligible expert GEMMs to hide
    # behind either, chunking only adds start-ups. With real GEMMs the chunks' GEMMs hide the
    # next chunk's collectives, and S2 wins again.
    instant = dataclasses.replace(DEVICES["h100"], hbm_bytes_per_s=1e30,
                                  peak_flops={"bfloat16": 1e30, "float32": 1e30})
    assert cost.choose(big, _hw(NVLINK, NVLINK, device=instant)).schedule == "parm_s1"
    assert cost.choose(big, _hw(IB, NVLINK, device=instant)).schedule == "parm_s2"
    assert cost.choose(big, _hw(NVLINK, NVLINK)).schedule == "parm_s2"
    # Synchronous collectives (CPU): nothing overlaps.
    assert cost.choose(big, _hw(IB, NVLINK, overlap=False)).schedule == "parm_s1"


def test_s2_crossover_matches_the_closed_form():
    # Two chunks of a two-stage pipeline with equal stage times t: S1 costs 2 * (2t) (a2a then
    # ag, each direction), S2 costs 3 * (t) plus one more alpha per collective: S2 wins exactly
    # when the time it hides, t_chunk, exceeds its extra start-ups alpha_a2a + alpha_ag.
    for a in (1e-6, 1e-4):
        inter = LinkSpec(name="x", bytes_per_s=50e9, latency_s=a)
        intra = LinkSpec(name="y", bytes_per_s=50e9 * 4 * 3 / 2 / 1, latency_s=a)
        s = _shape(tokens=8192, d_model=1024, d_ff=64, dtype_bytes=2)
        hw = _hw(inter, intra)
        s1 = cost.estimate(s, hw, "parm_s1").total_s
        s2 = cost.estimate(s, hw, "parm_s2", 2).total_s
        n = 8 * cost.slots(s, "parm_s1") * 1024 * 2
        hidden = collective_time("all-to-all", n / 2, 2, inter) - a  # bandwidth part of a chunk
        assert (s2 < s1) == (hidden > 2 * a), (a, s1, s2)


def _layer_hlo(mesh_text, schedule, shape, chunks=2):
    b, length, d, f, e, k, factor = shape
    mesh = make_mesh(mesh_text)
    x = jax.ShapeDtypeStruct((b, length, d), jnp.float32)
    w = {"w_in": jax.ShapeDtypeStruct((e, d, f), jnp.float32),
         "w_out": jax.ShapeDtypeStruct((e, f, d), jnp.float32)}

    def expert_fn(w, buf):
        return jnp.einsum("enf,efd->end", jax.nn.relu(jnp.einsum("end,edf->enf", buf,
                                                                  w["w_in"])), w["w_out"])

    def f_(x, router, w):
        with use_moe(MoESetup(schedule=schedule, chunks=chunks), get_rules("tp"), mesh):
            y, aux = moe_layer(x, router, w, expert_fn=expert_fn, bias_ED=None, names=NAMES,
                               args=MoEArgs(top_k=k, capacity_factor=factor))
        return y, aux

    with jax.set_mesh(mesh):
        compiled = jax.jit(f_).lower(x, jax.ShapeDtypeStruct((d, e), jnp.float32), w).compile()
    return analyze(compiled, mesh)[0], compiled.as_text(), mesh


def _model_collectives(mesh_text, schedule, shape, chunks):
    """(kind, axis, bytes) -> count by the model, for the layer alone (S1/S2's restore over MP
    belongs to the residual stream, outside the layer)."""
    b, length, d, f, e, k, factor = shape
    sizes = dict(make_mesh(mesh_text).shape)
    ep, mp = sizes.get("expert", 1), sizes.get("tensor", 1)
    s = cost.LayerShape(tokens=b * length // (sizes.get("data", 1) * ep), d_model=d, d_ff=f,
                        experts=e, top_k=k, capacity_factor=factor, dtype_bytes=4, ep=ep, mp=mp)
    out = {}
    for c in cost.collectives(s, schedule, chunks if schedule == "parm_s2" else 1,
                              restore=False):
        out[c.kind, c.axis, c.nbytes] = out.get((c.kind, c.axis, c.nbytes), 0) + c.count
    return out


def _compiled_collectives(analysis, min_bytes=256):
    """(kind, axis, bytes) -> count of the layer's activation-sized collectives (the router
    statistics' tiny all-reduces left out)."""
    out = {}
    for c in analysis.collectives:
        if c.bytes >= min_bytes:
            key = (c.kind, "+".join(c.axes), c.bytes)
            out[key] = out.get(key, 0) + c.count
    return out


GRID = [(mesh, sched, shape, chunks)
        for mesh in ("expert=2,tensor=4", "expert=4,tensor=2", "data=2,expert=2,tensor=2")
        for sched, chunks in (("ds_moe", 1), ("parm_s1", 1), ("parm_s2", 2), ("parm_s2", 4))
        for shape in ((8, 16, 16, 32, 8, 2, 1.0), (8, 32, 24, 16, 8, 1, 2.0))]


def _check_bytes(mesh_text, schedule, shape, chunks):
    analysis, _, _ = _layer_hlo(mesh_text, schedule, shape, chunks)
    assert _compiled_collectives(analysis) == _model_collectives(mesh_text, schedule, shape,
                                                                 chunks)


@pytest.mark.parametrize("mesh_text, schedule, shape, chunks", GRID[:4])
def test_model_bytes_equal_the_compiled_program(mesh_text, schedule, shape, chunks):
    _check_bytes(mesh_text, schedule, shape, chunks)


@pytest.mark.slow
@pytest.mark.parametrize("mesh_text, schedule, shape, chunks", GRID[4:])
def test_model_bytes_equal_the_compiled_program_grid(mesh_text, schedule, shape, chunks):
    _check_bytes(mesh_text, schedule, shape, chunks)


@pytest.mark.parametrize("schedule", ["parm_s1", "ds_moe"])
def test_s1_gates_each_token_once_and_all_reduces_nothing(schedule):
    shape = (8, 16, 16, 32, 8, 2, 1.0)  # E = 8 experts: the gate's dot is [rows, 8]
    analysis, text, mesh = _layer_hlo("expert=2,tensor=4", schedule, shape)
    t = 8 * 16 // 2  # tokens per MP group
    rows = {int(m) for m in re.findall(r"= f32\[(\d+),8\]\{[^}]*\} dot\(", text)}
    big_ar = [c for c in analysis.collectives if c.kind == "all-reduce" and c.bytes >= 256]
    if schedule == "parm_s1":
        assert rows == {t // 4}  # de-duplicated: each device gates T / mp tokens
        assert big_ar == []  # only the router statistics' few bytes are summed
    else:
        assert rows == {t}  # every MP rank gates all T duplicated tokens
        assert [c.bytes for c in big_ar] == [t * 16 * 4]
