"""The package's layers: imports run one way, down the layers, with no cycles (issue #18).

``sbloader/`` has one folder per layer, listed here from the bottom up; a module may
import modules of its own layer and of the layers below it, never above. The two
top-level utility modules (``transforms``, ``datagen``) sit beside ``sources``: they
may import ``core`` and ``sources``, and no layer imports them. ``sbloader/__init__.py``
re-exports the public names and may import anything. Every import counts, also one
inside a function or under ``TYPE_CHECKING``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "sbloader"
LAYERS = ("core", "runtime", "sources", "executor", "distributed", "loaders", "dataset")
UTILITIES = {"transforms": LAYERS.index("sources"), "datagen": LAYERS.index("sources")}
MAX_MODULE_LINES = 400


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" or p.parent != PACKAGE)


def _name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _rank(module: str) -> float | None:
    """The layer of an ``sbloader.`` module (a utility sits half a step above its highest import)."""
    parts = module.split(".")
    if parts[0] != "sbloader" or len(parts) < 2:
        return None
    if parts[1] in LAYERS:
        return float(LAYERS.index(parts[1]))
    if parts[1] in UTILITIES:
        return UTILITIES[parts[1]] + 0.5
    return None


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.level:
                raise AssertionError(f"{path}:{node.lineno}: use absolute imports (sbloader.<layer>.<module>)")
            out.append((node.module, node.lineno))
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
    return [(m, line) for m, line in out if m.startswith("sbloader")]


def test_the_folders_are_the_layers() -> None:
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and not p.name.startswith("__"))
    assert folders == sorted(LAYERS)
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert loose == sorted(UTILITIES)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: _name(p))
def test_imports_run_down_the_layers(path: Path) -> None:
    me = _rank(_name(path))
    assert me is not None, f"{path} is in no layer"
    upward = [f"line {line}: {m}" for m, line in _imports(path)
              if (_rank(m) is not None and _rank(m) > me)]
    assert not upward, f"{_name(path)} imports from a layer above it: {upward}"


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {}
    names = {_name(p) for p in _modules()}
    for p in _modules():
        deps = set()
        for m, _ in _imports(p):
            while m and m not in names:
                m = m.rpartition(".")[0]
            if m and m != _name(p):
                deps.add(m)
        graph[_name(p)] = deps
    seen: dict[str, int] = {}

    def visit(node: str, stack: list[str]) -> None:
        seen[node] = 1
        for dep in sorted(graph.get(node, ())):
            if seen.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep] if dep in stack else [node, dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in seen:
                visit(dep, stack + [dep])
        seen[node] = 2

    for node in sorted(graph):
        if node not in seen:
            visit(node, [node])


@pytest.mark.parametrize("path", _modules(), ids=lambda p: _name(p))
def test_modules_stay_small(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, f"{_name(path)} has {lines} lines; split it by concern"


MAX_PUBLIC_MEMBERS = 15
# The user's pipeline handle: its methods are the public API DESIGN.md names (transformations,
# introspection, iteration); each is a few lines over core.ops, executor.launch and loaders.
API_FACADES = {"sbloader.dataset.dataset.Dataset"}
FACADE_METHOD_LINES = 12


def _classes() -> list[tuple[str, ast.ClassDef]]:
    out = []
    for p in _modules():
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef):
                out.append((f"{_name(p)}.{node.name}", node))
    return out


@pytest.mark.parametrize("name,node", _classes(), ids=lambda x: x if isinstance(x, str) else "")
def test_no_class_has_more_than_fifteen_public_members(name: str, node: ast.ClassDef) -> None:
    public = [n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
              and not n.name.startswith("_")]
    if name in API_FACADES:
        # the public API's facade may have many methods, but each only forwards: a few lines of body
        for fn in node.body:
            if isinstance(fn, ast.FunctionDef) and not fn.name.startswith("_"):
                body = fn.body[1:] if ast.get_docstring(fn) else fn.body
                lines = body[-1].end_lineno - body[0].lineno + 1
                assert lines <= FACADE_METHOD_LINES, f"{name}.{fn.name} has {lines} lines of code; move its work down"
        return
    assert len(public) <= MAX_PUBLIC_MEMBERS, f"{name} has {len(public)} public methods: {public}; split it"
