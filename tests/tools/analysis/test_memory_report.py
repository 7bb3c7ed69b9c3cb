"""XLA's memory-usage report: parsed by hand from a written report, and read back from a real
compile whose buffers are known by hand arithmetic."""

import re

import jax
import jax.numpy as jnp
import pytest

from oases_jax.tools.analysis import memory_report as mr

REPORT = """Memory Space: default (color=0)
Total bytes: 3221225472 (3.00GiB)
  cumulative_size;       size;       offset; used_by_n_values; shapes_list
  ------------------------------------------------------------
    1.00GiB( 33%);  512.00MiB;   2147483648;                2; 2×f32[16,1024,8192]
    3.00GiB(100%);    2.00GiB;            0;               23; f32[16,2,16,1,1024,1024], s32[4]
    3.00GiB(100%);   64.00KiB;   3221159936;                1; bf16[32768]
Memory Space: host (color=5)
Total bytes: 1024 (1.00KiB)
    1.00KiB(100%);    1.00KiB;            0;                1; f32[256]
"""


def test_parse_by_hand():
    r = mr.parse(REPORT)
    assert r.total_bytes == 3 * 2**30  # the default memory space only
    assert [a.size_bytes for a in r.allocations] == [2 * 2**30, 512 * 2**20, 64 * 2**10]
    big = r.allocations[0]
    assert (big.offset, big.values) == (0, 23) and big.shapes.startswith("f32[16,2,16")
    text = r.format(2)
    assert "3.00 GiB in 3 allocations; the 2 largest" in text and "cum  83.3%" in text
    assert mr.MemoryReport.from_json(r.to_json(2)).format(2) == text
    with pytest.raises(ValueError, match="Total bytes"):
        mr.parse("Memory Space: default (color=0)\n")


def test_read_back_from_a_compile():
    """tanh(a @ b) @ b.T with a [256, 512], b [512, 1024] in f32: b is the largest buffer
    (2 MiB), the report's total is the compiled program's arguments + output + temporaries."""
    f = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b.T)
    lowered = f.lower(jax.ShapeDtypeStruct((256, 512), jnp.float32),
                      jax.ShapeDtypeStruct((512, 1024), jnp.float32))
    with mr.memory_dump() as (options, where):
        compiled = lowered.compile(compiler_options=options)
        name = re.match(r"HloModule (\S+?),", compiled.as_text()).group(1)
        report = mr.read(where, name)
    assert not where.exists()  # the dump is removed
    assert report.allocations[0].size_bytes == 512 * 1024 * 4
    assert "f32[512,1024]" in report.allocations[0].shapes
    m = compiled.memory_analysis()
    expected = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    assert abs(report.total_bytes - expected) <= 0.01 * expected
