"""The import graph of ``pagedmla/``, read from the source (ast): the layering the package promises.

Leaf modules (``device``, ``split_plan``, ``checks``, ``errors``, ``kv_format``) -> kernels -> ops (public API and
provider registry) -> backend -> model -> engine. Kernels import nothing from ``ops``; the modules imported at import
time form no cycle (imports for annotations only, under ``TYPE_CHECKING``, are not counted), and no import inside a
function body dodges one (the public ops reach their ``torch.library`` registrations by name,
``torch.ops.pagedmla.<op>``, rather than importing ``ops/library.py``, which imports them).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "pagedmla"

LEAVES = ("pagedmla.device", "pagedmla.split_plan", "pagedmla.checks", "pagedmla.errors", "pagedmla.kv_format")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The pagedmla module ``name`` refers to (a package's attribute import names a submodule or the package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_block(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(path: Path, modules: dict[str, Path]) -> tuple[set[str], set[str]]:
    """(modules imported at import time, modules imported inside function bodies) by ``path``; imports
    under ``if TYPE_CHECKING:`` (annotations only, never run) are neither."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    late: set[str] = set()
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking_block(child):
                continue
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    head = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(head + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in child.names]
            for name in names:
                if name.startswith("pagedmla"):
                    target = _resolve(name, modules)
                    if target is not None:
                        (late if inside else top).add(target)
            visit(child, inside)

    visit(tree, False)
    return top, late


def _graph() -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    modules = _modules()
    top, late = {}, {}
    for name, path in modules.items():
        top[name], late[name] = _imports(path, modules)
        # Importing a.b.c runs a/__init__ and a/b/__init__ first.
        parent = name.rpartition(".")[0]
        if parent:
            top[name].add(parent)
    return top, late


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` (as a path that returns to its start), or None; a package's own submodules
    importing it count only through their parent edge, which Python resolves (the package runs first)."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def _without_package_inits(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Import-time edges less the ones that run a package's __init__ for its submodules and the __init__'s
    re-exports of those submodules (``pagedmla/__init__`` imports backend, backend imports ``pagedmla.ops``
    whose __init__ runs first: Python's package semantics, not a dependency cycle between modules)."""
    packages = {m for m in graph if (PACKAGE.parent / m.replace(".", "/") / "__init__.py").exists()}
    out = {}
    for node, targets in graph.items():
        out[node] = {t for t in targets if not (t in packages and node.startswith(t + "."))}
        if node in packages:
            out[node] = {t for t in out[node] if not t.startswith(node + ".")}
    return out


def test_import_time_graph_has_no_cycle():
    top, _ = _graph()
    assert _cycle(_without_package_inits(top)) is None


def test_kernels_import_nothing_from_ops_or_above():
    top, late = _graph()
    for name in top:
        if name.startswith("pagedmla.kernels"):
            above = {t for t in top[name] | late[name]
                     if not t.startswith(("pagedmla.kernels",)) and t not in LEAVES and t != "pagedmla"}
            assert not above, f"{name} imports {sorted(above)}"


def test_leaf_modules_import_no_pagedmla_layer_above_them():
    top, late = _graph()
    for name in LEAVES:
        assert (top[name] | late[name]) - set(LEAVES) - {"pagedmla"} == set(), name


def test_late_imports_close_no_cycle():
    """A function-level import of a module that (at import time) reaches the importer back is a cycle
    dodged by deferring it: there is none."""
    top, late = _graph()
    plain = _without_package_inits(top)
    closing = {(src, dst) for src, dsts in late.items() for dst in dsts
               if src == dst or src in _reachable(plain, dst)}
    assert closing == set(), sorted(closing)
