"""The MoE sweep against compiled programs (`planner.verification.moe_compiled`), on 8 CPU devices
with small layers: every candidate compiles to the schedule it names (its collectives counted in the
compiled program), each row's times are our simulator's of those programs, auto's pick and its
ratio to the best follow, programs are compiled once per run, and the summary is checked by
hand."""

import re

import pytest

from oases_jax.errors import UserError
from oases_jax.hardware import get_cluster
from oases_jax.moe import cost as cost
from oases_jax.planner.verification.moe_compiled import (
    Config,
    compile_layer,
    markdown,
    simulate_layer,
    subset,
    summary,
    validate,
)
from oases_jax.tools.analysis.program import analyze_text
from oases_jax.tools.analysis.simulate import simulate

# 64 tokens per (data, expert) shard. First layer: T/mp = 16 gated per device, 3 slots per
# expert (so S2 runs 2 chunks); second: 32 per device, 2 slots.
LAYERS = [Config(cluster="cpu-8", ep=2, mp=4, experts=8, hidden=128, tokens=64, top_k=1,
                 capacity_factor=1.5),
          Config(cluster="cpu-8", ep=4, mp=2, experts=16, hidden=64, tokens=64, top_k=2,
                 capacity_factor=0.5)]
# the first layer's [T, D] tokens of one MP group (CPU collectives carry bf16 as float32)
TOKEN_BYTES = 64 * 128 * 4


def _counts(text, axes) -> dict:
    """(kind, axes, bytes) -> count of the activation-sized collectives of a program."""
    analysis, _ = analyze_text(text, axes)
    out = {}
    for c in analysis.collectives:
        if c.bytes >= 1024:
            key = (c.kind, "+".join(c.axes), c.bytes)
            out[key] = out.get(key, 0) + c.count
    return out


def _count(counts: dict, kind: str, axes: str, min_bytes: int = 0) -> int:
    return sum(n for (k, a, b), n in counts.items()
               if k == kind and a == axes and b >= min_bytes)


@pytest.fixture(scope="module")
def run():
    programs, calls = {}, []

    def timer(c, schedule, chunks, backward_chunks):
        calls.append((c, schedule, chunks, backward_chunks))
        text, axes, compile_s = compile_layer(c, schedule, chunks, backward_chunks)
        programs[c, schedule, chunks, backward_chunks] = text, axes
        return {**simulate_layer(c, text, axes), "compile_s": compile_s}

    rows = validate(LAYERS + LAYERS[:1], timer=timer)  # the repeated layer is not recompiled
    return rows, programs, calls


def test_each_candidate_compiles_to_its_schedule(run):
    rows, programs, calls = run
    assert len(calls) == len(set(calls)) == len(programs)
    c = LAYERS[0]
    assert cost.slots(c.shape(), "parm_s1") == 3
    assert {k[1:] for k in programs if k[0] == c} >= {("ds_moe", 1, 1), ("parm_s1", 1, 1),
                                                      ("parm_s2", 2, 2)}
    s1, s2, ds = (_counts(*programs[c, *k]) for k in (("parm_s1", 1, 1), ("parm_s2", 2, 2),
                                                       ("ds_moe", 1, 1)))
    # forward and backward: dispatch and combine all-to-alls per chunk
    assert _count(s1, "all-to-all", "expert") == 4 and _count(s2, "all-to-all", "expert") == 8
    assert _count(ds, "all-to-all", "expert") == 4
    # ds_moe restores its MP ranks' duplicated tokens by a sum (forward, and the input's
    # gradient, there with the router's statistics); S1, whose ranks hold a quarter of them
    # each, by all-gathers (the ESP all-gathers are 3 slots x 8 experts x mp: larger)
    assert _count(ds, "all-reduce", "tensor", TOKEN_BYTES) == 2
    assert _count(s1, "all-reduce", "tensor", TOKEN_BYTES) == 0
    assert _count(s1, "all-gather", "tensor", TOKEN_BYTES) == 4
    assert _count(ds, "all-gather", "tensor", TOKEN_BYTES) == 2


def test_rows_hold_the_simulated_programs_and_autos_pick(run):
    rows, programs, _ = run
    assert len(rows) == 3 and rows[2]["simulated"] == rows[0]["simulated"]
    for r, c in zip(rows, LAYERS + LAYERS[:1], strict=True):
        for name, sim in r["simulated"].items():
            sched, chunks, bwd = _parse(name)
            text, axes = programs[c, sched, chunks, bwd]
            assert sim["step_s"] == simulate(analyze_text(text, axes)[1],
                                             get_cluster("cpu-8")).step_s > 0
        auto = cost.choose(c.shape(), cost.MoEHardware.of(get_cluster("cpu-8"),
                                                          [0, c.mp], list(range(c.mp))))
        assert r["auto"] == auto.label and r["auto"] in r["simulated"]
        times = {k: v["step_s"] for k, v in r["simulated"].items()}
        assert r["best"] == min(times, key=times.get)
        assert r["auto_over_best"] == times[r["auto"]] / times[r["best"]] >= 1.0
        assert r["speedup"] == times["ds_moe"] / times[r["auto"]]
    text = markdown(rows)
    assert sum(line.startswith("| cpu-8 E=") for line in text.splitlines()) == 3


def _parse(name):
    m = re.fullmatch(r"parm_s2/(\d+)(?:\+(\d+))?", name)
    if m:
        return "parm_s2", int(m[1]), int(m[2] or m[1])
    return name, 1, 1


def _row(cluster, auto_over_best, speedup, best="parm_s1", model_best="parm_s1"):
    return {"cluster": cluster, "auto_over_best": auto_over_best, "speedup": speedup,
            "best_speedup": speedup * auto_over_best, "best": best, "model_best": model_best}


def test_summary_by_hand():
    rows = [_row("a", 1.0, 1.2), _row("a", 1.04, 1.0), _row("b", 1.2, 0.8, model_best="x"),
            _row("b", 1.0, 1.5)]
    s = summary(rows)
    assert s["all"]["within_5pct"] == 0.75 and s["a"]["within_5pct"] == 1.0
    assert s["b"]["within_5pct"] == 0.5 and s["all"]["auto_over_best_max"] == 1.2
    assert s["all"]["auto_speedup"] == {"min": 0.8, "median": 1.1, "max": 1.5}
    assert s["all"]["model_picks_best"] == 0.75


def test_subset_spreads_over_the_grid():
    layers = subset(12)
    assert len(layers) == 24 and layers[:12] == [
        Config(**{**c.to_json(), "cluster": "h100-8", "ep": 2, "mp": 4}) for c in layers[12:]]
    one = layers[:12]
    for field in ("experts", "hidden", "tokens"):
        assert sorted({getattr(c, field) for c in one}) == sorted(
            {8, 16, 32} if field == "experts" else {768, 1024, 2048} if field == "hidden"
            else {1024, 4096, 16384})
    assert len({(c.top_k, c.capacity_factor) for c in one}) == 4
    assert len({(c.experts, c.hidden) for c in one}) == 9
    with pytest.raises(UserError, match="--compiled 0"):
        subset(0)
