"""No import circle among the project's modules (astraflow/, astraflow_cli/, stream_apps/, trainers/).

Every import counts, at module level or inside a function (a lazy import only hides a circle),
except those under `if TYPE_CHECKING:`, which never run. A circle is reported with its modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("astraflow", "astraflow_cli", "stream_apps", "trainers")


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in (root / pkg).rglob("*.py"):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


class _Imports(ast.NodeVisitor):
    """The dotted names a module imports at run time (`from a import b` gives `a.b`)."""

    def __init__(self, module: str, is_package: bool) -> None:
        self.package = module.split(".") if is_package else module.split(".")[:-1]
        self.names: list[str] = []

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.names += [a.name for a in node.names]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:
            pkg = self.package[: len(self.package) - (node.level - 1)]
            base = ".".join([*pkg, base] if base else pkg)
        self.names += [f"{base}.{a.name}" for a in node.names]


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the project's modules it imports."""
    modules = _modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for mod, path in modules.items():
        visitor = _Imports(mod, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        graph[mod] = {r for n in visitor.names if (r := resolve(n)) and r != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_project_has_no_import_circle() -> None:
    graph = import_graph(ROOT)
    assert len(graph) > 150 and "astraflow.config" in graph  # the walk found the project
    assert circles(graph) == [], "import circles (break each with a module both sides import, or a Protocol)"


@pytest.mark.parametrize("files", [
    {"astraflow/a.py": "from astraflow import b\n", "astraflow/b.py": "def f():\n    from astraflow.a import x\n"},
    {"astraflow/a.py": "import astraflow.b.c\n", "astraflow/b/__init__.py": "", "astraflow/b/c.py": "from ..a import y\n"},
])
def test_a_lazy_or_relative_import_circle_is_found(tmp_path: Path, files: dict[str, str]) -> None:
    for name, text in {"astraflow/__init__.py": "", **files}.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    for pkg in PACKAGES[1:]:
        (tmp_path / pkg).mkdir()
    assert len(circles(import_graph(tmp_path))) == 1


def test_an_import_for_type_checking_only_is_no_circle(tmp_path: Path) -> None:
    (tmp_path / "astraflow").mkdir()
    for pkg in PACKAGES[1:]:
        (tmp_path / pkg).mkdir()
    (tmp_path / "astraflow/__init__.py").write_text("")
    (tmp_path / "astraflow/a.py").write_text("from astraflow.b import B\n")
    (tmp_path / "astraflow/b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from astraflow.a import A\n")
    graph = import_graph(tmp_path)
    assert graph["astraflow.a"] == {"astraflow.b"} and graph["astraflow.b"] == set()
    assert circles(graph) == []
