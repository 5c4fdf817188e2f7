"""The package's imports and layout: no cycle between its modules, no private name taken from another
module, one class per name, and which subpackages may import which."""

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
    """(module, names taken from it, line) for every import of a partime module in ``path``: at the
    top, inside a function, and under ``if TYPE_CHECKING:`` alike (a cycle a type checker or a late
    import hides is still two modules that each need the other)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
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


def _reached(start: str, edges: dict[str, set[str]]) -> set[str]:
    """The partime modules that importing ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for module in edges.get(todo.pop(), ()):
            if module not in seen:
                seen.add(module)
                todo.append(module)
    return seen


def _imported_from(packages: tuple[str, ...], others: str, edges: dict[str, set[str]]) -> list[str]:
    """``module -> imported`` for every module of ``packages`` that imports, directly or through
    others, a module of the package ``others``."""
    return [
        f"{module} -> {reached}"
        for module in sorted(edges)
        if module in packages or module.startswith(tuple(f"{p}." for p in packages))
        for reached in sorted(_reached(module, edges))
        if reached == others or reached.startswith(f"{others}.")
    ]


def test_the_reach_follows_imports_through_others() -> None:
    edges = {"a.x": {"b"}, "b": {"c.y"}, "c.y": set(), "d": {"a.x"}}
    assert _reached("a.x", edges) == {"b", "c.y"}
    assert _imported_from(("a",), "c", edges) == ["a.x -> c.y"]
    assert _imported_from(("d",), "c", edges) == ["d -> c.y"]
    assert _imported_from(("b",), "a", edges) == []


PROCESS = "partime.executors.process"

ON_ONE_RANK = ("partime.executors.distributed.plan", f"{PROCESS}.shared_memory", ["Channel"])
"""The one import of the process executor's code by another executor: ``plan.local_channel`` makes
the channels between two threads of rank 0 (the input, and the results and targets when the last
stage is rank 0's) as ``shared_memory.Channel``s on threading semaphores. Ranks themselves never
share memory: every link between two ranks is a ``RankLink``."""


def test_the_waiting_code_needs_no_process_executor() -> None:
    assert _imported_from(("partime.executors.waiting",), PROCESS, _edges()) == []


def test_the_thread_and_distributed_executors_need_the_process_executor_only_for_rank_0s_channels() -> None:
    importer, imported, names = ON_ONE_RANK
    path = MODULES[importer]
    assert [(m, n) for m, n, _ in _imports(importer, path) if m.startswith(PROCESS)] == [(imported, names)]
    edges = _edges()
    edges[importer] = edges[importer] - {imported}
    others = ("partime.executors.thread", "partime.executors.distributed")
    assert _imported_from(others, PROCESS, edges) == []


def test_the_learning_rules_need_no_executor() -> None:
    assert _imported_from(("partime.learning",), "partime.executors", _edges()) == []


STAGE_MODULES = {"stage", "config", "learning", "record", "kept_graph", "tensor_slots", "random_stream"}


def test_the_stages_modules_are_in_core_stage() -> None:
    inside = {m.removeprefix("partime.core.stage.") for m in MODULES if m.startswith("partime.core.stage.")}
    assert inside == STAGE_MODULES
    beside = {m.removeprefix("partime.core.") for m in MODULES if m.count(".") == 2 and m.startswith("partime.core.")}
    assert beside & STAGE_MODULES == {"stage"}  # the subpackage itself, nothing of it beside it
    assert [m for m in MODULES if m.rpartition(".")[2].startswith("stage_")] == []


def _classes() -> dict[str, list[str]]:
    """Every class of the package by name: where each one of that name is defined."""
    found: dict[str, list[str]] = {}
    for path in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found.setdefault(node.name, []).append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return found


def test_no_two_classes_share_a_name() -> None:
    classes = _classes()
    assert "Stage" in classes and "Pipeline" in classes  # the walk finds them
    assert {name: where for name, where in classes.items() if len(where) > 1} == {}
