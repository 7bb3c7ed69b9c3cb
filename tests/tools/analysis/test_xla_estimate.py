"""XLA's own estimate read from the latency-hiding schedule dump: hand-made dumps (no GPU needed)
and programs compiled for `h100:8` whose expected numbers are read from the raw dump text."""

import functools
import json
import pathlib
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from oases_jax.targets import get_target, has_gpu_aot
from oases_jax.tools.analysis import xla_compile, xla_dump, xla_estimate
from oases_jax.tools.analysis.xla_compile import compile_with_estimate, schedule_dump
from oases_jax.tools.analysis.xla_estimate import estimate_from_schedule
from tests.hlo_programs import ppermute_ring_matmul

gpu = pytest.mark.skipif(not has_gpu_aot(), reason="needs the gpu-aot extra")
US = 1e-6


def _instr(iid, name, opcode, *, called=(), config="", operands=()):
    lines = [f'      name: "{name}"', f'      opcode: "{opcode}"', f"      id: {iid}"]
    lines += [f"      operand_ids: {o}" for o in operands]
    lines += [f"      called_computation_ids: {c}" for c in called]
    if config:
        lines.append('      backend_config: "' + config.replace('"', '\\"') + '"')
    return "    instructions {\n" + "\n".join(lines) + "\n      shape {\n        element_type: F32"\
        "\n      }\n    }\n"


def _sol(us):
    costs = [{"exec_time_us": 10 * us, "name": ""}, {"exec_time_us": us, "name": "sol"}]
    return json.dumps({"reification_cost": costs})


def _comp(cid, name, instrs):
    return f'  computations {{\n    name: "{name}"\n{"".join(instrs)}    id: {cid}\n  }}\n'


def _schedule(cid, times, stats):
    rows = "".join(
        f"  instructions {{\n    id: {i}\n    start_timestamp_cycles: {s}\n"
        f"    end_timestamp_cycles: {e}\n  }}\n" for i, s, e in times)
    st = "".join(f"    {k}: {v}\n" for k, v in stats.items())
    return (f"computation_schedules {{\n  computation_id: {cid}\n{rows}"
            f"  scheduler_statistics {{\n{st}  }}\n  cycles_per_microsecond: 1\n}}\n")


def _hand_dump() -> str:
    """An entry (not scheduled) around a 3-trip while whose body (scheduled) overlaps a permute
    with a fusion; the entry also runs two priced fusions and an unpriced copy."""
    body = _comp(1, "body", [
        _instr(10, "p", "parameter"),
        _instr(11, "cp-start", "async-start", called=[4]),
        _instr(12, "gemm", "fusion", called=[5], config=_sol(30)),
        _instr(13, "cp-done", "async-done", called=[4], operands=[11]),
        _instr(14, "t", "tuple")])
    cond = _comp(2, "cond", [_instr(20, "p.1", "parameter"),
                             _instr(21, "cmp", "fusion", called=[5], config=_sol(0.5))])
    entry = _comp(3, "main", [
        _instr(30, "a", "parameter"),
        _instr(31, "pre", "fusion", called=[5], config=_sol(7)),
        _instr(32, "c", "copy"),
        _instr(33, "w", "while", called=[1, 2], config='{"known_trip_count":{"n":"3"}}'),
        _instr(34, "post", "fusion", called=[5], config=_sol(11))])
    wrapped = _comp(4, "async_computation", [
        _instr(40, "p.2", "parameter"),
        _instr(41, "permute", "collective-permute", config=_sol(50))])
    fused = _comp(5, "fused", [_instr(50, "x", "parameter")])
    module = ('hlo_module {\n  name: "m"\n  entry_computation_name: "main"\n'
              + fused + wrapped + body + cond + entry + "  entry_computation_id: 3\n}\n")
    # Body: start 1 us, gemm 30 us, the done waits 50 - 31 = 19 us more: total 1+30+19+1 = 51.
    times = [(10, 0, 0), (11, 0, 1), (12, 1, 31), (13, 50, 51), (14, 51, 51)]
    stats = {"collective_permute_wasted_cycles": 19, "total_wasted_cycles": 19,
             "total_cycles": 51}
    return module + _schedule(1, times, stats)


def test_composes_an_unscheduled_entry_around_a_scheduled_loop_body():
    est = estimate_from_schedule(_hand_dump())
    # entry: 7 + 11 (copy unpriced) + 3 x body 51 + 4 x condition 0.5
    assert est.step_s == pytest.approx((7 + 11 + 3 * 51 + 4 * 0.5) * US)
    assert est.exposed_comm_s == pytest.approx(
        {"collective-permute": 3 * 19 * US, "total": 3 * 19 * US})
    assert est.comm_s == pytest.approx({"collective-permute": 3 * 50 * US, "total": 150 * US})
    assert est.unpriced_ops == 1 and est.scheduled_computations == ["body"]
    # The timeline: pre, then per trip the condition, the permute and the GEMM; then post.
    names = [o.name for o in est.per_op]
    assert names == ["pre"] + ["cmp", "cp-start", "gemm"] * 3 + ["cmp", "post"]
    gemms = [o for o in est.per_op if o.name == "gemm"]
    assert [round(o.start / US, 6) for o in gemms] == [7 + 0.5 + 1, 7 + 51 + 1.0 + 1,
                                                       7 + 102 + 1.5 + 1]
    perms = [o for o in est.per_op if o.stream == "comm"]
    assert all(o.end - o.start == pytest.approx(50 * US) for o in perms)
    assert est.per_op[-1].name == "post" and est.per_op[-1].end == pytest.approx(est.step_s)
    assert est.to_json()["per_op"][0] == {"name": "pre", "kind": "fusion", "stream": "compute",
                                          "start": 0.0, "end": pytest.approx(7 * US)}


def test_a_scheduled_computation_replaces_the_nominal_price_of_its_loop():
    text = _hand_dump()
    # Schedule the entry too: the while gets XLA's nominal 0.01 us, which the loop's time replaces.
    times = [(30, 0, 0), (31, 0, 7), (32, 7, 7.01), (33, 7.01, 7.02), (34, 7.02, 18.02)]
    text += _schedule(3, times, {"total_cycles": 18.02})
    est = estimate_from_schedule(text)
    assert est.step_s == pytest.approx((18.02 - 0.01 + 3 * 51 + 4 * 0.5) * US)
    post = est.per_op[-1]
    assert post.name == "post" and post.end == pytest.approx(est.step_s)


def test_a_priced_op_replaces_xlas_price_and_its_computation_is_replayed():
    # The body's GEMM given 60 us (as `xla_compile` prices a fused-attention call XLA gave 10):
    # the permute (50 us) now hides behind it, so the body is replayed, not read from XLA's
    # statistics: start 1 + 60 + done 1 = 62 us, nothing exposed.
    est = estimate_from_schedule(_hand_dump(), prices={"gemm": 60 * US})
    assert est.step_s == pytest.approx((7 + 11 + 3 * 62 + 4 * 0.5) * US)
    assert est.exposed_comm_s == {"total": 0}
    assert est.fused_attention == {"calls": 3, "xla_s": pytest.approx(3 * 30 * US),
                                   "priced_s": pytest.approx(3 * 60 * US)}
    gemm = next(o for o in est.per_op if o.name == "gemm")
    assert gemm.end - gemm.start == pytest.approx(60 * US)
    assert estimate_from_schedule(_hand_dump()).fused_attention is None


def test_text_format_strings_and_skipped_fields():
    proto = xla_dump.parse_text_proto(
        'hlo_module {\n  name: "a\\"b\\\\c\\n"\n  device_assignment {\n    x {\n    }\n  }\n'
        '  computations {\n    id: 3\n  }\n}\n')
    (module,) = proto["hlo_module"]
    assert module["name"] == ['a"b\\c\n'] and "device_assignment" not in module
    assert module["computations"] == [{"id": [3]}]


def test_no_dump_directory_is_left_behind_even_on_errors():
    tmp = pathlib.Path(tempfile.gettempdir())
    before = set(tmp.glob("oases-xla-dump-*"))
    with schedule_dump() as (options, where):
        assert where.is_dir() and options["xla_dump_to"] == str(where)
        (where / "x.schedule.txt").write_text("junk")
    assert not where.exists()

    class Failing:
        def compile(self, compiler_options=None):
            raise RuntimeError("XLA said no")

    with pytest.raises(RuntimeError, match="XLA said no"):
        compile_with_estimate(Failing(), {})
    assert set(tmp.glob("oases-xla-dump-*")) == before


# Programs compiled for h100:8. Expected values come from the raw dump text with regular
# expressions, not from the parser under test.


@functools.cache
def _mesh() -> Mesh:
    return Mesh(np.asarray(get_target("h100:8").devices, dtype=object), ("tensor",))


def _arg(shape, spec):
    return jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(_mesh(), spec))


def _compile_and_dump(f, *args) -> tuple[xla_estimate.XlaEstimate, str]:
    lowered = jax.jit(f).lower(*args)
    with schedule_dump() as (options, where):
        compiled = lowered.compile(compiler_options={
            "xla_gpu_enable_latency_hiding_scheduler": True, **options})
        (path,) = xla_compile.schedule_files(where)
        raw = path.read_text()
        est = xla_compile.read_dump(where, compiled.as_text())
    return est, raw


_SOL = re.compile(r'exec_time_us\\":([0-9.e+-]+)[^{}]*?\\"name\\":\\"sol\\"')


def _blocks(raw: str) -> dict[int, tuple[str, str]]:
    """Each computation's (name, text) in the dumped module, by id."""
    out = {}
    for m in re.finditer(r"^  computations \{\n(.*?)^  \}\n", raw, re.S | re.M):
        name = re.search(r'^    name: "([^"]+)"', m.group(1), re.M).group(1)
        out[int(re.search(r"^    id: (\d+)", m.group(1), re.M).group(1))] = (name, m.group(1))
    return out


def _sols(block: str) -> list[float]:
    return [float(x) for x in _SOL.findall(block)]


def _stat(raw: str, key: str) -> list[float]:
    return [float(x) for x in re.findall(rf"^\s+{key}: ([0-9.e+-]+)$", raw, re.M)]


def _times(raw: str, name: str) -> tuple[float, float]:
    """Scheduled start and end (us) of the instruction called `name`."""
    iid = re.search(rf'name: "{re.escape(name)}"\n(?:.*\n)*?      id: (\d+)', raw).group(1)
    m = re.search(rf"    id: {iid}\n(?:    start_timestamp_cycles: ([0-9.e+-]+)\n)?"
                  rf"(?:    end_timestamp_cycles: ([0-9.e+-]+)\n)?", raw.split(
                      "computation_schedules")[1])
    return float(m.group(1) or 0), float(m.group(2) or 0)


def _all_gather_then_dot(x_blk, w_blk):
    return jax.lax.all_gather(x_blk, "tensor", tiled=True) @ w_blk


def _ring(x_blk, w_blk, n=8):
    """The ring, with one more op on its result so the loop's output is consumed."""
    return jnp.tanh(ppermute_ring_matmul(x_blk, w_blk, n))


def _shard(f):
    return jax.shard_map(f, mesh=_mesh(), in_specs=(P("tensor", None), P(None, "tensor")),
                         out_specs=P(None, "tensor"))


ROWS, K, COLS = 8192, 4096, 16384  # bf16 x: [ROWS, K] over 8 devices, w: [K, COLS] over 8


def _args():
    return _arg((ROWS, K), P("tensor", None)), _arg((K, COLS), P(None, "tensor"))


@pytest.mark.gpu_aot
@gpu
def test_blocking_all_gather_is_exposed_for_its_whole_time():
    est, raw = _compile_and_dump(_shard(_all_gather_then_dot), *_args())
    blocks = _blocks(raw)
    (ag_us,) = [s for _, b in blocks.values() if 'opcode: "all-gather"' in b for s in _sols(b)]
    start, end = _times(raw, "all-gather-start")
    # Nothing overlaps: the compute stream waits for the whole all-gather, less the start op's
    # own cost (XLA prices a start at 1 us and counts it as overlap).
    assert est.exposed_comm_s["all-gather"] == pytest.approx((ag_us - (end - start)) * US)
    assert est.exposed_comm_s["total"] == est.exposed_comm_s["all-gather"]
    assert est.exposed_comm_s["all-gather"] == pytest.approx(ag_us * US, rel=0.01)
    assert est.comm_s["all-gather"] == pytest.approx(ag_us * US)
    assert est.step_s == pytest.approx(_stat(raw, "total_cycles")[0] * US)


@pytest.mark.gpu_aot
@gpu
def test_ring_loop_hides_part_of_each_permute_and_composes_by_hand():
    est, raw = _compile_and_dump(_shard(_ring), *_args())
    blocks = _blocks(raw)
    entry = int(re.search(r"entry_computation_id: (\d+)", raw).group(1))
    loop = re.search(r'opcode: "while"\n(?:.*\n)*?      called_computation_ids: (\d+)\n'
                     r'      called_computation_ids: (\d+)\n', raw)
    body, cond = int(loop.group(1)), int(loop.group(2))
    assert est.scheduled_computations == [blocks[body][0]]  # only the loop body is scheduled
    trips = int(re.search(r'known_trip_count\\":\{\\"n\\":\\"(\d+)', raw).group(1))
    assert trips == 8
    (permute_us,) = [s for _, b in blocks.values() if 'opcode: "collective-permute"' in b
                     for s in _sols(b)]
    # The GEMM in the window hides part of each permute, not all of it.
    assert 0 < est.exposed_comm_s["collective-permute"] < est.comm_s["collective-permute"]
    assert est.comm_s["collective-permute"] == pytest.approx(trips * permute_us * US)
    (wasted,) = _stat(raw, "collective_permute_wasted_cycles")
    assert est.exposed_comm_s["collective-permute"] == pytest.approx(trips * wasted * US)
    # Step by hand: the entry's priced instructions, the body's total cycles per trip, and the
    # condition's instructions once more than the body.
    (body_total,) = _stat(raw, "total_cycles")
    expected = (sum(_sols(blocks[entry][1])) + trips * body_total
                + (trips + 1) * sum(_sols(blocks[cond][1])))
    assert est.step_s == pytest.approx(expected * US)
    assert est.step_s > trips * body_total * US


def test_xla_timeline_is_drawn_from_a_report(tmp_path):
    pytest.importorskip("matplotlib")
    from oases_jax.tools import report

    est = estimate_from_schedule(_hand_dump())
    r = {"schedule": "ring", "target": "h100:8", "xla_estimate": est.to_json()}
    events = report.xla_events(r)
    assert [e.name for e in events] == [o.name for o in est.per_op]
    report.draw_timeline(None, r, str(tmp_path / "x.png"), source="xla")
    assert (tmp_path / "x.png").stat().st_size > 0
    with pytest.raises(ValueError, match="GPU targets only"):
        report.xla_events({**r, "xla_estimate": None})


def test_async_non_collective_work_is_priced_at_what_it_wraps():
    """XLA's scheduler gives an async fusion a nominal 5000 us; it runs for its wrapped price."""
    main = _comp(3, "main", [
        _instr(30, "a", "parameter"),
        _instr(31, "fusion-start", "async-start", called=[4]),
        _instr(32, "gemm", "fusion", called=[5], config=_sol(30)),
        _instr(33, "fusion-done", "async-done", called=[4], operands=[31]),
        _instr(34, "cp-start", "collective-permute-start", config=_sol(40)),
        _instr(35, "cp-done", "collective-permute-done", operands=[34])])
    wrapped = _comp(4, "async_computation", [
        _instr(40, "p", "parameter"), _instr(41, "slice", "fusion", called=[5], config=_sol(4))])
    fused = _comp(5, "fused", [_instr(50, "x", "parameter")])
    module = ('hlo_module {\n  name: "m"\n  entry_computation_name: "main"\n'
              + fused + wrapped + main + "  entry_computation_id: 3\n}\n")
    times = [(30, 0, 0), (31, 0, 1), (32, 1, 31), (33, 5000, 5001), (34, 5001, 5002),
             (35, 5041, 5042)]
    stats = {"collective_permute_wasted_cycles": 39, "total_wasted_cycles": 39,
             "total_cycles": 5042}
    est = estimate_from_schedule(module + _schedule(3, times, stats))
    # start 1, GEMM 30 (covers the 4 us fusion), done 1, permute start 1, waits 39, done 1
    assert est.step_s == pytest.approx((1 + 30 + 1 + 1 + 39 + 1) * US)
    assert est.exposed_comm_s == pytest.approx({"collective-permute": 39 * US, "total": 39 * US})
    assert "1 x fusion" in est.notes[0]
    side = [o for o in est.per_op if o.stream == "async"]
    assert [(o.name, o.start) for o in side] == [("fusion-start", 0.0)]
    assert side[0].end == pytest.approx(4 * US)
