"""XLA's own account of a compiled program's peak memory: the buffer assignment's allocations,
largest first, each with the shapes of the values that share it. XLA writes it as
`<module>...-memory-usage-report.txt` when a compile dumps its HLO as text (`memory_dump`).

What it shows that the peak alone does not: which values hold the bytes. The planner's "FSDP
layers keep their gathered weights" term came from it (docs/planner.md, the benchmark set).
"""

from __future__ import annotations

import dataclasses
import pathlib
import re

from oases_jax.tools.analysis.xla_compile import xla_dump

# Per-compile options that make XLA dump the optimized module as text, with its buffer
# assignment and memory-usage report beside it. `xla_dump_to` is added per call.
DUMP_OPTIONS = {"xla_dump_hlo_as_text": True}

_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_TOTAL = re.compile(r"^Total bytes:\s*(\d+)")
# "    2.00GiB(  9%);    2.00GiB;            0;               23; f32[1,2], 2×f32[4]"
_ROW = re.compile(r"^\s*[\d.]+\s*\w+\(\s*\d+%\);\s*([\d.]+)\s*(\w+);\s*(\d+);\s*(\d+);\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Allocation:
    size_bytes: int  # as XLA prints it (three significant digits)
    offset: int  # in the memory space's one heap
    values: int  # how many values share the allocation over the program
    shapes: str  # their shapes, "2×f32[4096]" for two of one shape

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    total_bytes: int
    allocations: tuple[Allocation, ...]  # largest first
    n_allocations: int | None = None  # all of them, where `allocations` holds only the top

    def to_json(self, top: int) -> dict:
        return {"total_bytes": self.total_bytes, "n_allocations": len(self.allocations),
                "allocations": [a.to_json() for a in self.allocations[:top]]}

    @classmethod
    def from_json(cls, d: dict) -> MemoryReport:
        """The `to_json` form back (only its `top` allocations)."""
        return cls(d["total_bytes"], tuple(Allocation(**a) for a in d["allocations"]),
                   d.get("n_allocations"))

    def format(self, top: int) -> str:
        """The `top` largest allocations, one line each, with their running share."""
        n = self.n_allocations or len(self.allocations)
        lines = [f"XLA's memory-usage report: {self.total_bytes / 2**30:.2f} GiB in {n} "
                 f"allocations; the {min(top, len(self.allocations))} largest:"]
        running = 0
        for a in self.allocations[:top]:
            running += a.size_bytes
            share = 100 * running / self.total_bytes if self.total_bytes else 0.0
            lines.append(f"  {a.size_bytes / 2**20:10.1f} MiB  (cum {share:5.1f}%)  "
                         f"{a.values:4d} values: {a.shapes[:150]}")
        return "\n".join(lines)


def parse(text: str) -> MemoryReport:
    """A `*-memory-usage-report.txt` (the default memory space's section)."""
    total, rows, section = None, [], 0
    for line in text.splitlines():
        if line.startswith("Memory Space:"):
            section += 1
            if section > 1:
                break
            continue
        m = _TOTAL.match(line)
        if m:
            total = int(m.group(1))
            continue
        m = _ROW.match(line)
        if m:
            size, unit, offset, values, shapes = m.groups()
            if unit not in _UNITS:
                raise ValueError(f"memory-usage report: unknown unit {unit!r} in {line!r}")
            rows.append(Allocation(round(float(size) * _UNITS[unit]), int(offset), int(values),
                                   shapes.strip()))
    if total is None:
        raise ValueError("not a memory-usage report: no 'Total bytes' line")
    return MemoryReport(total, tuple(sorted(rows, key=lambda a: -a.size_bytes)))


def read(where: pathlib.Path, module: str | None = None) -> MemoryReport | None:
    """The report of `module` (the compiled module's name, e.g. from `HloModule jit_step,`) in
    a dump directory; without a name, the largest one there (a compile dumps small helper
    modules too). None when the dump holds none."""
    files = sorted(where.glob("*-memory-usage-report.txt"))
    if module:
        files = [f for f in files if f".{module}." in f.name] or files
    if not files:
        return None
    reports = [parse(f.read_text()) for f in files]
    return max(reports, key=lambda r: r.total_bytes)


def memory_dump():
    """Compiler options that dump the optimized module (and its memory-usage report) into a
    fresh directory, removed on exit (`xla_compile.xla_dump`): `with memory_dump() as
    (options, where): ...compile(compiler_options={**mine, **options}); read(where)`."""
    return xla_dump(DUMP_OPTIONS)
