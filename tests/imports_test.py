"""The layering of docs/architecture.md ("Layering"), checked on the source with ``ast``.

Every ``import`` / ``from ... import`` of every product module counts, wherever it stands (module
level, inside a function, under ``if TYPE_CHECKING``). The test fails on

* an import of a package the importer's package may not import (one above it, or a peer), named by
  file:line and both packages;
* an import circle between modules of the repository, named module by module with the file:line of
  each import;
* a backend package importing another (``backends/*``; the kernel backends ``kernels/{triton,tilelang,
  cudnn}``).

An import names a module of the repository when it, or a prefix of it, is one: ``from core.thd import
x`` is an edge to ``core.thd``, ``from core import thd`` too (``thd`` is a module), ``from train import
run_training`` an edge to ``train`` (the package's ``__init__``). A submodule's implicit import of its
parent package is not an edge (every package ``__init__`` that imports its own submodules would be a
circle). Loading a factory by name (``record.load()``, importlib) is not an import statement.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Package -> the packages it may import, top to bottom (docs/architecture.md, "Layering").
MAY_IMPORT = {
    "bench": {"launchers", "orchestration", "train", "rollout", "engine", "backends", "kernels", "converters",
              "reporting", "core"},
    "launchers": {"orchestration", "train", "rollout", "engine", "backends", "kernels", "converters", "reporting",
                  "core"},
    "orchestration": {"train", "rollout", "engine", "backends", "kernels", "converters", "reporting", "core"},
    "train": {"rollout", "engine", "backends", "kernels", "converters", "reporting", "core"},
    "rollout": {"engine", "backends", "kernels", "converters", "reporting", "core"},
    "backends": {"engine", "kernels", "converters", "reporting", "core"},
    "engine": {"kernels", "converters", "reporting", "core"},
    "kernels": {"reporting", "core"},
    "converters": {"reporting", "core"},
    "reporting": {"core"},
    "core": set(),
}
PACKAGES = tuple(MAY_IMPORT)


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every product module."""
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The repository module ``name`` lands in (its longest prefix that is one), or None."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[int, str, str | None]]:
    """``(line, imported name, repository module or None)`` of every import statement in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, _owner(a.name)) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                found.append((node.lineno, sub if sub in MODULES else source, _owner(sub)))
    return found


def _graph() -> dict[str, dict[str, int]]:
    """module -> {imported repository module: first line}."""
    graph = {}
    for module, path in MODULES.items():
        edges = graph.setdefault(module, {})
        for line, _, target in _imports(module, path):
            if target is not None and target != module:
                edges.setdefault(target, line)
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Circles (``[a, b, ..., a]``) covering every module of each strongly connected component."""
    index, low, stack, on_stack, comps = {}, {}, [], set(), []

    def visit(v):  # Tarjan; the graph is a few hundred modules deep at most
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
                comps.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for comp in comps:  # shortest circles through the component's members until each is on one
        covered = set()
        for start in sorted(comp):
            if start not in covered:
                cycles.append(_shortest_circle(graph, comp, start))
                covered.update(cycles[-1])
    return cycles


def _shortest_circle(graph: dict[str, dict[str, int]], comp: set[str], start: str) -> list[str]:
    """``[start, ..., start]``, the shortest path back to ``start`` inside the component ``comp``."""
    prev, frontier = {start: None}, [start]
    while not any(start in graph[v] for v in frontier):
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w in comp and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    path = [next(v for v in frontier if start in graph[v])]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])
    return path[::-1] + [start]


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT)}:{line}"


def test_the_source_is_there():
    for pkg in PACKAGES:
        assert pkg in MODULES, f"{pkg}/__init__.py is not in the runfiles"
    assert {"core.thd", "train.trainer", "rollout.reference_engine", "orchestration.launch", "launchers.cli"} <= set(MODULES)


def test_no_package_imports_one_above_it():
    wrong = []
    for module, path in MODULES.items():
        pkg = module.split(".")[0]
        for line, name, _ in _imports(module, path):
            top = name.split(".")[0]
            if top in MAY_IMPORT and top != pkg and top not in MAY_IMPORT[pkg]:
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {pkg} imports {top} ({name})")
    assert not wrong, "imports against the layering (docs/architecture.md):\n" + "\n".join(wrong)


# Backend packages that never import each other (the reference kernels and kernels/gpu_common.py are shared).
SIBLINGS = {"backends": {"miles", "megatron", "cpu", "nvidia", "rocm"}, "kernels": {"triton", "tilelang", "cudnn"}}


def test_backends_never_import_each_other():
    wrong = []
    for module, path in MODULES.items():
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in SIBLINGS.get(parts[0], ()):
            continue
        for line, name, _ in _imports(module, path):
            other = name.split(".")
            if other[0] == parts[0] and len(other) > 1 and other[1] in SIBLINGS[parts[0]] - {parts[1]}:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {parts[0]}.{parts[1]} imports {name}")
    assert not wrong, "backends importing each other:\n" + "\n".join(wrong)


def test_no_import_circles():
    graph = _graph()
    report = []
    for cycle in _cycles(graph):
        steps = [f"{a} -> {b} ({_where(a, graph[a][b])})" for a, b in zip(cycle, cycle[1:])]
        report.append(" -> ".join(cycle) + "\n    " + "\n    ".join(steps))
    assert not report, "import circles:\n" + "\n".join(report)


# The one product module that may touch megatron-core's parallel-state globals: it starts them and builds the
# run's layout (issue #33, item 2); every other module reads the layout.
LAYOUT_MODULE = "engine.layout"
PARALLEL_STATE = ("megatron.core.parallel_state", "megatron.core.mpu")


def _parallel_state_reads(path: Path) -> list[int]:
    """Lines of ``path`` that import megatron-core's parallel state or reach it as an attribute."""
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Attribute) and node.attr in ("parallel_state", "mpu"):
            names = [ast.unparse(node)]
        if any(n == ps or n.startswith(ps + ".") for n in names for ps in PARALLEL_STATE):
            lines.append(node.lineno)
    return lines


def test_only_the_layout_module_reads_megatrons_parallel_state():
    wrong = [f"{path.relative_to(ROOT)}:{line}" for module, path in MODULES.items() if module != LAYOUT_MODULE
             for line in _parallel_state_reads(path)]
    assert not wrong, ("megatron-core's parallel_state read outside engine/layout.py (read the run's layout, "
                       "engine.layout.current(), instead):\n" + "\n".join(wrong))
    assert _parallel_state_reads(MODULES[LAYOUT_MODULE]), "engine/layout.py no longer starts the parallel state"


def test_the_parallel_state_checker_sees_every_spelling(tmp_path):
    spellings = ["from megatron.core import parallel_state as ps", "import megatron.core.parallel_state",
                 "from megatron.core.parallel_state import get_data_parallel_group",
                 "import megatron.core\nx = megatron.core.parallel_state", "from megatron.core import mpu"]
    for i, text in enumerate(spellings):
        f = tmp_path / f"m{i}.py"
        f.write_text(text + "\n")
        assert _parallel_state_reads(f), text
    ok = tmp_path / "ok.py"
    ok.write_text("from megatron.core import tensor_parallel\nfrom engine.layout import current\n")
    assert not _parallel_state_reads(ok)


def test_the_checker_sees_a_circle_and_a_wrong_import():
    graph = {"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {"a": 4}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []
    assert "launchers" not in MAY_IMPORT["train"] and "backends" not in MAY_IMPORT["engine"]
    assert "orchestration" not in MAY_IMPORT["train"] and "train" not in MAY_IMPORT["rollout"]


if __name__ == "__main__":
    from tests.runner import main as run_tests

    run_tests(__file__)
