"""The schedule simulator against hand arithmetic."""

import pytest

from oases_jax.hardware import LinkSpec, collective_time, get_cluster
from oases_jax.tools.analysis.program import Program
from oases_jax.tools.analysis.simulate import Simulator

HEAD = "HloModule m\n\n%add (a: f32[], b: f32[]) -> f32[] {\n  %a = f32[] parameter(0)\n" \
       "  %b = f32[] parameter(1)\n  ROOT %s = f32[] add(%a, %b)\n}\n\n"


def _sim(text, compute, comm):
    """Simulate with hand costs: `compute` maps op names to seconds; every collective costs
    `comm`."""
    program = Program(text, (("tensor", 2),))
    return Simulator(
        program, get_cluster("h100:8"),
        compute_cost=lambda comp, instr: compute.get(instr.name, 0.0),
        comm_cost=lambda comp, idx, instr, kind: comm,
    ).run()


ASYNC = HEAD + """ENTRY %main (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %ar-start = f32[4]{0} all-reduce-start(%p0), replica_groups={{0,1}}, to_apply=%add
  %work = f32[4]{0} multiply(%p0, %p0)
  %ar-done = f32[4]{0} all-reduce-done(%ar-start)
  ROOT %out = f32[4]{0} add(%work, %ar-done)
}
"""
SYNC = HEAD + """ENTRY %main (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %ar = f32[4]{0} all-reduce(%p0), replica_groups={{0,1}}, to_apply=%add
  %work = f32[4]{0} multiply(%p0, %p0)
  ROOT %out = f32[4]{0} add(%work, %ar)
}
"""


def test_hidden_communication_costs_nothing():
    r = _sim(ASYNC, {"work": 3.0}, 2.0)
    assert (r.step_s, r.compute_s, r.comm_s, r.exposed_comm_s) == (3.0, 3.0, 2.0, 0.0)


def test_blocking_communication_adds_up():
    r = _sim(SYNC, {"work": 3.0}, 2.0)
    assert (r.step_s, r.compute_s, r.comm_s, r.exposed_comm_s) == (5.0, 3.0, 2.0, 2.0)


def test_longer_comm_is_partly_exposed():
    r = _sim(ASYNC, {"work": 3.0}, 5.0)
    assert (r.step_s, r.exposed_comm_s) == (5.0, 2.0)


def test_loop_body_replays_trip_count_times():
    text = HEAD + """%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4]{0} get-tuple-element(%p), index=1
  %cp-start = (f32[4]{0}, f32[4]{0}) collective-permute-start(%x), source_target_pairs={{0,1},{1,0}}
  %work = f32[4]{0} multiply(%x, %x)
  %cp-done = f32[4]{0} collective-permute-done(%cp-start)
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4]{0}) tuple(%next, %cp-done)
}

%cond (q: (s32[], f32[4])) -> pred[] {
  %q = (s32[], f32[4]{0}) parameter(0)
  %j = s32[] get-tuple-element(%q), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

ENTRY %main (p0: f32[4]) -> f32[4] {
  %p0 = f32[4]{0} parameter(0)
  %zero = s32[] constant(0)
  %init = (s32[], f32[4]{0}) tuple(%zero, %p0)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  ROOT %r = f32[4]{0} get-tuple-element(%w), index=1
}
"""
    # Each trip: max(compute 3, comm 4) = 4; three trips = 12, of which 3 x 1 exposed.
    r = _sim(text, {"work": 3.0}, 4.0)
    assert (r.step_s, r.compute_s, r.comm_s, r.exposed_comm_s) == (12.0, 9.0, 12.0, 3.0)


def test_alpha_beta_formulas_by_hand():
    link = LinkSpec(name="l", bytes_per_s=100.0, latency_s=1.0)
    assert collective_time("all-reduce", 800, 8, link) == pytest.approx(2 * 7 / 8 * 8 + 2 * 7)
    assert collective_time("all-gather", 800, 8, link) == pytest.approx(7 / 8 * 8 + 7)
    assert collective_time("reduce-scatter", 800, 4, link) == pytest.approx(3 / 4 * 8 + 3)
    assert collective_time("collective-permute", 800, 2, link) == pytest.approx(8 + 1)
    assert collective_time("all-reduce", 800, 1, link) == 0.0


def test_links_by_level():
    cluster = get_cluster("h100-32")
    assert cluster.link_for([0, 7]).name == "nvlink4"
    assert cluster.link_for([0, 8]).name == "ib-400g"
    nv = get_cluster("3090-nvlink-32")
    assert [nv.link_for(g).name for g in ([0, 1], [0, 2], [3, 4], [0, 4, 8], [0, 1, 4, 5])] == [
        "nvlink-bridge", "pcie-host-staged", "ib-100g", "ib-100g", "ib-100g"]
    # A group inside two servers crosses the host-staged PCIe (4.3 GB/s) in each of them as
    # well as the InfiniBand (12.5 GB/s) between them: PCIe is the slowest link it crosses.
    pcie = get_cluster("3090-pcie-32")
    assert [pcie.link_for(g).name for g in (range(8), [0, 4], [0, 1], [2])] == [
        "pcie-host-staged", "ib-100g", "pcie-host-staged", "pcie-host-staged"]
    assert nv.link_for(range(8)).name == "pcie-host-staged"


def test_roofline_compute_cost():
    text = HEAD + """ENTRY %main (a: bf16[1024,1024], b: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[1024,1024]{1,0} parameter(0)
  %b = bf16[1024,1024]{1,0} parameter(1)
  ROOT %d = bf16[1024,1024]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    program = Program(text, (("tensor", 1),))
    sim = Simulator(program, get_cluster("h100:8"))
    comp = program.comp("main")
    t = sim.compute_time(comp, comp.by_name["d"])
    flops, nbytes = 2 * 1024**3, 3 * 1024 * 1024 * 2
    assert t == pytest.approx(max(flops / 989e12, nbytes / 3.35e12))


def test_covered_time_is_the_compute_inside_each_window():
    """A 5 s all-reduce beside 3 s of compute: 3 s covered, 2 exposed (hidden share 0.6); the
    synchronous one is covered by nothing; a collective with compute after its done is not
    covered by it."""
    r = _sim(ASYNC, {"work": 3.0}, 5.0)
    assert r.covered == {"all-reduce": (5.0, 3.0)}
    assert r.hidden_share == pytest.approx(0.6) and r.exposed_share == pytest.approx(2.0 / 5.0)
    r = _sim(ASYNC, {"work": 3.0}, 2.0)
    assert r.covered == {"all-reduce": (2.0, 2.0)} and r.hidden_share == 1.0
    r = _sim(SYNC, {"work": 3.0}, 2.0)
    assert r.covered == {"all-reduce": (2.0, 0.0)} and r.hidden_share == 0.0
    late = ASYNC.replace("  %work = f32[4]{0} multiply(%p0, %p0)\n  %ar-done = f32[4]{0} "
                         "all-reduce-done(%ar-start)\n",
                         "  %ar-done = f32[4]{0} all-reduce-done(%ar-start)\n"
                         "  %work = f32[4]{0} multiply(%p0, %p0)\n")
    r = _sim(late, {"work": 3.0}, 2.0)
    assert r.covered == {"all-reduce": (2.0, 0.0)} and r.step_s == 5.0
    assert r.to_json()["covered_by_kind"]["all-reduce"] == {"comm_s": 2.0, "covered_s": 0.0,
                                                            "share": 0.0}
