"""The house rules of imports, read from the source with `ast` (every import, at module or
function level): no cycles between modules, packages import only the packages below them, and
no library module grows past 400 lines.

Layering, lowest first: the `oases_jax` core (pure JAX: never Flax) <- `oases_jax.analysis` <-
`models` <- `training` <- `tools` <- `planner` <- `scripts`. A module may import its own package
and those below it.
"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
LIBRARY = ("oases_jax", "models", "training", "tools", "planner")
LAYERS = ("oases_jax", "oases_jax.analysis", "models", "training", "tools", "planner", "scripts")
PURE_JAX = {"flax"}  # never imported by `oases_jax`, core or analysis
MAX_LINES = 400


def module_files() -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of the library packages and scripts/."""
    out = {}
    for top in (*LIBRARY, "scripts"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
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
    assert {"planner", "planner.search", "oases_jax.analysis.hardware", "scripts.plan"} <= set(
        MODULES)
    assert "planner.layer_cost" in graph["planner.search"]
    assert "planner.plan" in graph["scripts.plan"]  # imported inside main()
    assert "oases_jax.registry" in graph["planner.search"]  # `from oases_jax import registry`
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
        if layer(module).startswith("oases_jax"):
            bad += [f"{path.relative_to(ROOT)}:{line} imports {name}, but oases_jax is pure JAX"
                    for name, line in imported(module, path) if name.split(".")[0] in PURE_JAX]
    assert not bad, ("imports against the layering " + " <- ".join(LAYERS) + ":\n  "
                     + "\n  ".join(sorted(bad)))


def test_library_modules_stay_under_400_lines():
    long = {str(p.relative_to(ROOT)): n for m, p in MODULES.items()
            if layer(m) != "scripts" and (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, (f"modules over {MAX_LINES} lines (one concept per module; split them): "
                      + ", ".join(f"{p} ({n})" for p, n in sorted(long.items())))
