"""The code's shape, checked: parts small enough to read, imports that point one way.

The bars (docs/ARCHITECTURE.md, "Bars"): in the installed package (``paged_jax/``,
``models/`` as ``paged_jax.models``, ``pallas_kernels/`` as ``paged_jax.kernels``) no file over
800 lines, no function over 120 lines except the argument parsers named in
``LONG_FUNCTIONS_ALLOWED``, no class in ``paged_jax/`` or ``models/`` over 500 lines counting
the in-project classes it inherits from, no import cycle between its modules (imports inside
functions included), and nothing imported from ``benchmarks`` (a folder that is not
installed). Read from the source with ``ast``; nothing is imported.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = {
    "paged_jax": "paged_jax",
    "models": "paged_jax.models",
    "pallas_kernels": "paged_jax.kernels",
}
MAX_FILE_LINES = 800
MAX_FUNCTION_LINES = 120
MAX_CLASS_LINES = 500
# (file, function): argument parsers, one add_argument after another, read as a table
LONG_FUNCTIONS_ALLOWED = {("paged_jax/cli/flags.py", "_parser")}


def _sources() -> dict[str, pathlib.Path]:
    """Module name (as installed) -> its file, for every module of the package."""
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([package, *parts])] = path
    return mods


SOURCES = _sources()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in SOURCES.items()}


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _imported(name: str, tree: ast.Module) -> set[str]:
    """Every module ``name``'s source imports (relative imports resolved): for ``from
    package import x``, the submodule ``package.x`` where there is one, else ``package``."""
    package = name if SOURCES[name].name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package
                for _ in range(node.level - 1):
                    up = up.rpartition(".")[0]
                base = f"{up}.{base}" if base else up
            for a in node.names:  # a submodule by name, or a name from ``base``
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in SOURCES else base)
    return out


def _in_project(module: str) -> str | None:
    """The project module that importing ``module`` runs (the longest known prefix)."""
    while module and module not in SOURCES:
        module = module.rpartition(".")[0]
    return module or None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for name, tree in TREES.items():
        deps = {_in_project(m) for m in _imported(name, tree)} - {None, name}
        graph[name] = deps
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_file_is_over_the_bar():
    long = {
        _rel(p): n
        for p in SOURCES.values()
        if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES
    }
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_is_over_the_bar():
    long = {}
    for name, tree in TREES.items():
        rel = _rel(SOURCES[name])
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_FUNCTION_LINES and (rel, node.name) not in LONG_FUNCTIONS_ALLOWED:
                    long[f"{rel}:{node.name}"] = size
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def _classes() -> dict[str, tuple[int, list[str], str]]:
    """Class name -> (its lines, its bases' names, its file) over paged_jax/ and models/."""
    classes = {}
    for name, tree in TREES.items():
        if name.startswith("paged_jax.kernels"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [
                    b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
                ]
                size = node.end_lineno - node.lineno + 1
                if size > classes.get(node.name, (0,))[0]:  # the largest of a name
                    classes[node.name] = (size, bases, _rel(SOURCES[name]))
    return classes


def _with_bases(name: str, classes, seen: tuple[str, ...] = ()) -> int:
    if name not in classes or name in seen:
        return 0
    size, bases, _ = classes[name]
    return size + sum(_with_bases(b, classes, (*seen, name)) for b in bases)


def test_no_class_is_over_the_bar_counting_what_it_inherits():
    classes = _classes()
    long = {
        f"{classes[c][2]}:{c}": total
        for c in classes
        if (total := _with_bases(c, classes)) > MAX_CLASS_LINES
    }
    assert not long, f"classes over {MAX_CLASS_LINES} lines with their in-project bases: {long}"


def test_the_class_bar_counts_inherited_lines():
    """The measure itself: a mixin's lines count toward the class that inherits it."""
    classes = {"A": (300, [], "a.py"), "B": (250, ["A", "object"], "b.py")}
    assert _with_bases("B", classes) == 550
    assert _with_bases("A", classes) == 300


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, f"modules importing each other (directly or around a loop): {cycles}"


def test_the_cycle_finder_finds_a_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_relative_imports_resolve_to_project_modules():
    """A check of the graph's reading: known edges are there (relative and absolute)."""
    graph = _graph()
    assert "paged_jax.engine.request" in graph["paged_jax.engine.scheduler"]
    assert "paged_jax.engine.core" in graph["paged_jax.engine.llm"]
    assert "paged_jax.kernels.gpu._block" in graph["paged_jax.kernels.gpu.ragged"]


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_the_package_imports_nothing_from_benchmarks(name):
    bad = sorted(m for m in _imported(name, TREES[name]) if m.split(".")[0] == "benchmarks")
    assert not bad, f"{_rel(SOURCES[name])} imports {bad}: benchmarks/ is not installed"
