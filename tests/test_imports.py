"""The package's imports: no cycle between its modules, no private name taken from another module."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "partime"


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _source(name: str, path: Path, node: ast.ImportFrom) -> str:
    """The module an ``import from`` in module ``name`` (file ``path``) takes its names from."""
    if not node.level:
        return node.module or ""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _imports(name: str, path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names taken from it, line) for every import of a partime module in ``path``, but
    those only a type checker reads (under ``if TYPE_CHECKING:``)."""
    tree = ast.parse(path.read_text())
    checking = {
        id(node)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for statement in block.body
        for node in ast.walk(statement)
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in checking:
            continue
        if isinstance(node, ast.ImportFrom):
            module = _source(name, path, node)
            if module.split(".")[0] == "partime":
                found.append((module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "partime"]
    return found


def _edges() -> dict[str, set[str]]:
    """Which partime modules each one imports (a submodule taken by name counts as that module)."""
    edges: dict[str, set[str]] = {name: set() for name in MODULES}
    for name, path in MODULES.items():
        for module, names, _ in _imports(name, path):
            targets = {f"{module}.{n}" for n in names if f"{module}.{n}" in MODULES}
            if len(targets) < len(names) or not names:
                targets.add(module)
            edges[name] |= targets - {name}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
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
                components.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def test_the_checker_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others() -> None:
    assert _cycles(_edges()) == []


def test_no_private_name_is_imported_from_another_module() -> None:
    private = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}.{n}"
        for name, path in MODULES.items()
        for module, names, line in _imports(name, path)
        for n in names
        if n.startswith("_") and not n.startswith("__")
    ]
    assert private == []


def test_no_private_name_is_read_off_another_module() -> None:
    private = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = {
            a.asname or a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom)
            for a in node.names
            if f"{_source(name, path, node)}.{a.name}" in MODULES
        }
        for node in ast.walk(tree):
            read = isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
            if read and node.attr.startswith("_") and not node.attr.startswith("__"):
                private.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value.id}.{node.attr}")
    assert private == []


def test_every_import_inside_the_package_is_relative() -> None:
    absolute = []
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "partime":
                absolute.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: from {node.module}")
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "partime" for a in node.names):
                absolute.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: import")
    assert absolute == []


def test_every_subpackage_says_what_it_holds() -> None:
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, init
