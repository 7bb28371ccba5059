"""No import circles: each module of flowgrpo/, rewards/ and samplers/ can be read after the ones it imports.

The graph is read from the source (``ast``), nothing is imported. An edge ``a -> b`` is an import in ``a`` that
runs ``b``'s module code: ``import b``, ``from b import name`` and ``from . import b`` (a submodule), plus the
packages above ``b``. Two kinds of import are left out: those under ``if TYPE_CHECKING:`` (never run), and a
module's import of a package it lies in (``from .registry import x`` inside ``rewards/`` runs ``rewards/__init__``
only when that is already being imported), unless it takes a name defined there (``from . import name``).

No circle anywhere, counting imports inside functions too: those run later, so a circle through them works, but it
is still a circle a reader walks back and forth."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("flowgrpo", "rewards", "samplers")


def module_files(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file, for every ``.py`` under ``packages`` (a package is its ``__init__``)."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(tree: ast.Module, *, in_functions: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module runs (``in_functions``: also those in function bodies),
    leaving out ``if TYPE_CHECKING:`` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                visit(node.orelse)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                if in_functions:
                    visit(node.body)
            else:  # if / try / with / for / class bodies run with the module
                for field in ("body", "orelse", "finalbody", "handlers"):
                    children = getattr(node, field, [])
                    for child in children:
                        visit(child.body if isinstance(child, ast.ExceptHandler) else [child])

    visit(tree.body)
    return found


def import_graph(files: dict[str, Path], *, in_functions: bool = False) -> dict[str, set[str]]:
    """Module -> the modules (of ``files``) whose code its imports run; see the module docstring for the rules."""
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        above = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
        targets: set[tuple[str, bool]] = set()  # (module, whether a name defined in it is taken)
        for node in _imports(ast.parse(path.read_text(encoding="utf-8")), in_functions=in_functions):
            if isinstance(node, ast.Import):
                targets.update((alias.name, False) for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                targets.add((sub, False) if sub in files else (base, True))
        edges = set()
        for target, takes_name in targets:
            parts = target.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name in files and name != module and (name not in above or (takes_name and name == target)):
                    edges.add(name)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(found)


def test_the_cycle_finder_sees_a_circle_and_ignores_what_never_runs():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    files = module_files()
    graph = import_graph(files)
    assert "flowgrpo.checkpoint.safe_io" in graph["flowgrpo.checkpoint.save"]
    assert "flowgrpo.parallel" in graph["flowgrpo.checkpoint.optimizer"]
    assert "flowgrpo.config" not in graph["flowgrpo.checkpoint.save"]  # under TYPE_CHECKING only
    assert "flowgrpo.adapters" in import_graph(files, in_functions=True)["flowgrpo.checkpoint.save"]


def test_no_module_level_import_circle():
    found = cycles(import_graph(module_files()))
    assert found == [], "import circles (module level): " + "; ".join(" <-> ".join(c) for c in found)


def test_no_import_circle_even_through_imports_inside_functions():
    found = cycles(import_graph(module_files(), in_functions=True))
    assert found == [], "import circles (counting function imports): " + "; ".join(" <-> ".join(c) for c in found)
