"""The MoE cost model: byte counts by hand arithmetic and against the compiled CPU programs,
S1's de-duplication read from the HLO (no activation all-reduce, the gate sees T/mp rows), and
the S1/S2 choice at its crossover."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import pytest

from oases_jax.hardware import DEVICES, LinkSpec, Prices, collective_time
from oases_jax.mesh import make_mesh
from oases_jax.moe import MoEArgs, MoESetup, moe_layer, use_moe
from oases_jax.moe import cost as cost
from oases_jax.rules import get_rules
from oases_jax.tools.analysis.program import analyze

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


def _hw(inter: LinkSpec, intra: LinkSpec, overlap=True, device=DEVICES["h100"],
        concurrent=False):
    return cost.MoEHardware(prices=Prices(device, async_collectives=overlap), ep_link=inter,
                            mp_link=intra, same_level=inter == intra,
                            concurrent_links=concurrent)


NVLINK = LinkSpec(name="nvlink", bytes_per_s=450e9, latency_s=3e-6)
IB = LinkSpec(name="ib", bytes_per_s=50e9, latency_s=8e-6)
INSTANT = dataclasses.replace(DEVICES["h100"], hbm_bytes_per_s=1e30,
                              peak_flops={"bfloat16": 1e30, "float32": 1e30})


def test_serial_layer_is_the_sum_of_its_tasks():
    """Synchronous collectives (CPU): every task runs after the one before, forward and
    backward, so each direction is the sum of its tasks, written out here."""
    s = _shape(tokens=4096, d_model=1024, d_ff=4096, dtype_bytes=2, top_k=2)
    dev = DEVICES["h100"]
    hbm, peak = dev.hbm_bytes_per_s, dev.peak("bfloat16")
    est = cost.estimate(s, _hw(IB, NVLINK, overlap=False), "parm_s1")
    c = cost.slots(s, "parm_s1")  # ceil(2 * 1024 / 8) = 256 slots per expert
    assert c == 256
    n = 8 * c * 1024 * 2  # the [E, C, D] buffer
    a2a = collective_time("all-to-all", n, 2, IB)
    ag = collective_time("all-gather", 4 * n, 4, NVLINK)
    rs = collective_time("reduce-scatter", 4 * n, 4, NVLINK)
    restore = collective_time("all-gather", 4096 * 1024 * 2, 4, NVLINK)
    stats = collective_time("all-reduce", (2 * 8 + 3) * 4, 8, IB)  # over expert x tensor
    grad = collective_time("all-reduce", 1024 * 8 * 4, 8, IB)
    rows, f, w = 8 * 4 * c, 1024, 4 * 1024 * 1024 * 2  # 4 local experts' [D, F/mp] in bf16
    flops = 2.0 * rows * 1024 * f
    io, act = rows * (1024 + f) * 2, rows * f * 2
    fwd_ffn = 2 * max(flops / peak, (w + io) / hbm) + 3 * act / hbm
    dgrad = 2 * max(flops / peak, (w + io) / hbm) + 4 * act / hbm
    wgrad = 2 * max(flops / peak, (2 * w + io) / hbm)
    t = 1024  # tokens gated per device (T / mp)
    gate = max(2.0 * t * 1024 * 8 / peak, t * 1024 * 2 / hbm)
    row = t * 1024 * 2 / hbm
    cast = 2 * 3 * w / hbm
    assert est.forward_s == pytest.approx(
        cast + gate + 3 * row + a2a + ag + fwd_ffn + rs + a2a + 3 * row + restore, rel=1e-12)
    assert est.backward_s == pytest.approx(
        5 * row + a2a + ag + dgrad + stats + rs + a2a + wgrad + 2 * gate + 4 * row + grad
        + restore, rel=1e-12)


def test_router_all_reduces_span_the_devices_that_gate_different_tokens():
    # S1's MP ranks gate different tokens: 8 = expert x tensor devices sum the router's
    # statistics and gradient; ds_moe's gate the same: expert's 2, on the EP link alone.
    s = _shape(dp=2)
    hw = _hw(IB, NVLINK)
    assert cost._router_all_reduces(s, hw, "parm_s1") == (
        collective_time("all-reduce", 19 * 4, 16, IB),
        collective_time("all-reduce", 16 * 8 * 4, 16, IB))
    assert cost._router_all_reduces(s, hw, "ds_moe") == (
        collective_time("all-reduce", 19 * 4, 4, IB),
        collective_time("all-reduce", 16 * 8 * 4, 4, IB))


def test_one_collective_stream_gives_chunks_nothing_to_hide_without_compute():
    # XLA's GPU runtime runs the collectives one at a time: with free compute, S2's chunks only
    # add each collective's start-ups: 2 (ep - 1) alpha_ep + 2 (mp - 1) alpha_mp per direction
    # and chunk beyond the first.
    s = _shape(tokens=16384, d_model=2048, d_ff=8192, dtype_bytes=2, capacity_factor=2.0)
    hw = _hw(IB, NVLINK, device=INSTANT)
    s1, s2 = cost.estimate(s, hw, "parm_s1"), cost.estimate(s, hw, "parm_s2", 2)
    extra = 2 * 1 * 8e-6 + 2 * 3 * 3e-6
    assert s2.forward_s - s1.forward_s == pytest.approx(extra, rel=1e-9)
    assert s2.backward_s - s1.backward_s == pytest.approx(extra, rel=1e-9)
    assert cost.choose(s, hw).label in ("parm_s1", "ds_moe")


def test_concurrent_links_pipeline_by_hand():
    """Parm's premise (collectives on two link levels at once), free compute, every stage's
    bandwidth part A over the whole buffer, latencies a1 (all-to-all, ep = 2: one step) and
    a2 (all-gather and reduce-scatter, mp = 4: three steps). S1: 4A + 2 a1 + 2 a2. S2 with two
    chunks of A/2: all-to-alls at [0, a], [a, 2a] (a = A/2 + a1); all-gathers, each after its
    chunk's all-to-all and the previous all-gather, end at a + g and a + 2g (g = A/2 + a2 >= a);
    reduce-scatters at a + 3g, a + 4g; the all-to-alls back end at 2a + 3g and 2a + 4g: 3A +
    2 a1 + 4 a2. S2 wins exactly when A > 2 a2."""
    for alpha in (1e-6, 1e-4):
        inter = LinkSpec(name="x", bytes_per_s=50e9, latency_s=alpha)
        intra = LinkSpec(name="y", bytes_per_s=6 * 50e9, latency_s=alpha)  # equal A
        s = _shape(tokens=8192, d_model=1024, d_ff=64, dtype_bytes=2)
        hw = _hw(inter, intra, device=INSTANT, concurrent=True)
        n = 8 * cost.slots(s, "parm_s1") * 1024 * 2
        big_a = n / 2 / 50e9
        a1, a2 = alpha, 3 * alpha
        restore = collective_time("all-gather", 8192 * 1024 * 2, 4, intra)
        s1 = cost.estimate(s, hw, "parm_s1").forward_s - restore
        s2 = cost.estimate(s, hw, "parm_s2", 2).forward_s - restore
        assert s1 == pytest.approx(4 * big_a + 2 * a1 + 2 * a2, rel=1e-9)
        assert s2 == pytest.approx(3 * big_a + 2 * a1 + 4 * a2, rel=1e-9)
        assert (s2 < s1) == (big_a > 2 * a2)


def test_forward_and_backward_chunk_counts_are_chosen_separately():
    # One H100 node: two forward chunks hide the second chunk's collectives behind the first's
    # expert GEMMs; the backward's weight-gradient GEMMs hide its unchunked reduce-scatter and
    # all-to-all back, so one backward chunk saves the second's start-ups.
    s = cost.LayerShape(tokens=4096, d_model=1024, d_ff=4096, experts=8, top_k=1,
                        capacity_factor=1.0, dtype_bytes=2, ep=2, mp=4)
    hw = _hw(NVLINK, NVLINK)
    best = cost.choose(s, hw)
    assert (best.schedule, best.chunks, best.backward_chunks) == ("parm_s2", 2, 1)
    assert best.label == "parm_s2/2+1"
    two, one = cost.estimate(s, hw, "parm_s2", 2), cost.estimate(s, hw, "parm_s1")
    assert best.forward_s == two.forward_s < one.forward_s  # the same padding (C = 128)
    assert best.backward_s < two.backward_s


def _layer_hlo(mesh_text, schedule, shape, chunks=2, backward_chunks=None):
    """The layer's compiled forward, or with `backward_chunks` its forward and its gradient
    with respect to x and the experts."""
    b, length, d, f, e, k, factor = shape
    mesh = make_mesh(mesh_text)
    x = jax.ShapeDtypeStruct((b, length, d), jnp.float32)
    w = {"w_in": jax.ShapeDtypeStruct((e, d, f), jnp.float32),
         "w_out": jax.ShapeDtypeStruct((e, f, d), jnp.float32)}

    def expert_fn(w, buf):
        return jnp.einsum("enf,efd->end", jax.nn.relu(jnp.einsum("end,edf->enf", buf,
                                                                  w["w_in"])), w["w_out"])

    setup = MoESetup(schedule=schedule, chunks=chunks, backward_chunks=backward_chunks or 0)

    def f_(x, router, w):
        with use_moe(setup, get_rules("tp"), mesh):
            y, aux = moe_layer(x, router, w, expert_fn=expert_fn, bias_ED=None, names=NAMES,
                               args=MoEArgs(top_k=k, capacity_factor=factor))
        return y, aux

    if backward_chunks:
        def f_(x, router, w, f_=f_):  # noqa: F811
            return jax.grad(lambda x, w: jnp.sum(jnp.square(f_(x, router, w)[0])),
                            argnums=(0, 1))(x, w)

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


def test_backward_collectives_run_over_their_own_chunks():
    """parm_s2 with 2 forward and 4 backward chunks: the forward's all-to-alls, all-gathers and
    reduce-scatters are the model's for 2 chunks, the backward's those for 4, byte for byte."""
    shape = (8, 16, 16, 32, 8, 2, 1.0)
    analysis, _, _ = _layer_hlo("expert=2,tensor=4", "parm_s2", shape, 2, backward_chunks=4)
    fwd = _model_collectives("expert=2,tensor=4", "parm_s2", shape, 2)
    bwd = _model_collectives("expert=2,tensor=4", "parm_s2", shape, 4)
    assert set(fwd).isdisjoint(bwd)
    assert _compiled_collectives(analysis) == fwd | bwd


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
