"""The house rules of imports, read from the source with `ast` (every import, at module or
function level): no cycles between modules, packages import only the packages below them, and
library modules stay readable in size (a warning past 600 lines, a failure past 800).

Everything installs under one namespace, `oases_jax`, each top-level folder as one subpackage
(pyproject.toml's package-dir). Layering, lowest first: the `oases_jax` core (pure JAX: never
Flax; meshes, rules, collectives, schedules, the hardware model, the pipeline and MoE runtimes)
<- `oases_jax.models` <- `oases_jax.training` <- `oases_jax.tools` (inspection: HLO parsing,
the simulator, XLA's estimate) <- `oases_jax.planner` <- `oases_jax.scripts`. A module may
import its own package and those below it.
"""

import ast
import pathlib
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
# folder -> the package it installs as (pyproject.toml's [tool.setuptools.package-dir])
FOLDERS = {"oases_jax": "oases_jax", "models": "oases_jax.models",
           "training": "oases_jax.training", "tools": "oases_jax.tools",
           "planner": "oases_jax.planner", "scripts": "oases_jax.scripts"}
LAYERS = ("oases_jax", "oases_jax.models", "oases_jax.training", "oases_jax.tools",
          "oases_jax.planner", "oases_jax.scripts")
PURE_JAX = {"flax"}  # never imported by the `oases_jax` core
# The planner's own order, lowest first, by the name below `oases_jax.planner` (its sub-packages
# by job, and its top modules where they sit); its `__init__` gathers the entry points.
PLANNER = ("layout", "calibration", "cost", "search", "plan_schema", "plan", "verification")
WARN_LINES, MAX_LINES = 600, 800


def module_files() -> dict[str, pathlib.Path]:
    """Installed dotted module name -> file, for every module of the mapped folders."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join((package, *parts))] = path
    return out


MODULES = module_files()


def layer(module: str) -> str:
    """The entry of `LAYERS` a module belongs to (its longest matching prefix)."""
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def imported(module: str, path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported name, line) for every import in the file: absolute dotted names, relative
    imports resolved, `from a import b` as `a.b`."""
    is_package = path.name == "__init__.py"
    package = module.split(".") if is_package else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package[:len(package) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def resolve(name: str) -> str | None:
    """The project module an imported name lands in (its longest prefix that is one), or None
    for anything outside the project."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in MODULES:
            return ".".join(parts[:n])
    return None


def import_graph() -> dict[str, dict[str, int]]:
    """module -> {imported project module: line of its first import}."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, {})
        for name, line in imported(module, path):
            target = resolve(name)
            if target is not None and target != module:
                edges.setdefault(target, line)
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected component of more than one
    module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    out = []
    for comp in components:
        start = min(comp)
        # Breadth-first within the component for the shortest way back to `start`.
        prev: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v]):
                    if w in comp and w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(prev[path[-1]])
        out.append(path[::-1])
    return out


def test_the_graph_sees_every_kind_of_import():
    """The parser finds function-level and relative imports and resolves `from a import b`."""
    graph = import_graph()
    assert {"oases_jax.planner", "oases_jax.planner.search.dense", "oases_jax.hardware",
            "oases_jax.scripts.plan"} <= set(MODULES)
    assert "oases_jax.planner.cost.layer_cost" in graph["oases_jax.planner.search.dense"]
    assert "oases_jax.planner.plan" in graph["oases_jax.scripts.plan"]  # imported inside main()
    # `from oases_jax import registry`
    assert "oases_jax.registry" in graph["oases_jax.planner.search.dense"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [
        ["a", "b", "c", "a"]]


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_imports_follow_the_package_layering():
    bad = []
    for module, edges in import_graph().items():
        rank = LAYERS.index(layer(module))
        for target, line in edges.items():
            if LAYERS.index(layer(target)) > rank:
                bad.append(f"{MODULES[module].relative_to(ROOT)}:{line} ({layer(module)}) "
                           f"imports {target} ({layer(target)})")
    for module, path in MODULES.items():
        if layer(module) == "oases_jax":
            bad += [f"{path.relative_to(ROOT)}:{line} imports {name}, "
                    "but the oases_jax core is pure JAX"
                    for name, line in imported(module, path) if name.split(".")[0] in PURE_JAX]
    assert not bad, ("imports against the layering " + " <- ".join(LAYERS) + ":\n  "
                     + "\n  ".join(sorted(bad)))


def test_planner_sub_packages_follow_their_order():
    """calibration <- cost <- search <- plans <- verification: the cost model reads profiles,
    the searches price with the cost model, plans record search results, and verification
    compiles plans."""
    def part(module):
        rest = module.split(".")[2:]
        return rest[0] if rest else None

    planner = {m: e for m, e in import_graph().items() if layer(m) == "oases_jax.planner"}
    assert {part(m) for m in planner} - {None} == set(PLANNER)
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line} ({part(m)}) imports {t} ({part(t)})"
           for m, edges in planner.items() if part(m) is not None
           for t, line in edges.items() if layer(t) == "oases_jax.planner" and part(t)
           and PLANNER.index(part(t)) > PLANNER.index(part(m))]
    assert not bad, "planner imports against " + " <- ".join(PLANNER) + ":\n  " + "\n  ".join(
        sorted(bad))


def test_library_modules_stay_readable_in_size():
    """Past 600 lines a module probably holds two concepts (a warning); past 800 it fails."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines())
             for m, p in MODULES.items() if layer(m) != "oases_jax.scripts"}
    long = {p: n for p, n in sizes.items() if n > WARN_LINES}
    if long:
        warnings.warn(f"modules over {WARN_LINES} lines (one concept per module?): "
                      + ", ".join(f"{p} ({n})" for p, n in sorted(long.items())), stacklevel=1)
    too_long = {p: n for p, n in long.items() if n > MAX_LINES}
    assert not too_long, (f"modules over {MAX_LINES} lines (split them by concept): "
                          + ", ".join(f"{p} ({n})" for p, n in sorted(too_long.items())))


def test_nothing_imports_a_folder_by_its_bare_name():
    """`models`, `planner`, ... install as `oases_jax.models`, ...; imported bare they resolve
    only from a checkout on `sys.path`, as a second copy of every module."""
    bare = set(FOLDERS) - {"oases_jax"}
    files = [*MODULES.values(), *(p for p in (ROOT / "tests").rglob("*.py")
                                  if p.name != "test_wheel.py"),
             *(ROOT / "benchmarks").rglob("*.py")]
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
           for p in files for name, line in imported("", p) if name.split(".")[0] in bare]
    assert not bad, "import these through oases_jax (oases_jax.models, ...):\n  " + "\n  ".join(
        bad)
