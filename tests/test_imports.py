"""The package's imports and layout: no cycle between its modules, no private name taken from another
module, one class per name, and which subpackages may import which; and how the code around it (the
tools, the benchmarks, the examples, the experiments) reaches it: through its public API and its one
seam, ``partime.internals``, which nothing inside the package imports and which holds no dead name."""

from __future__ import annotations

import ast
import importlib
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


# -- the code around the package ------------------------------------------------------------------

ROOT = PACKAGE.parents[1]
USERS = (ROOT / "src" / "partime_tools", ROOT / "benchmarks", ROOT / "examples", ROOT / "experiments")
"""The code that uses partime from outside: the tools, the benchmarks, the examples and the experiments."""

API = (
    "partime",
    "partime.sources",
    "partime.metrics",
    "partime.streams",
    "partime.video",
    "partime.checkpoint",
    "partime.optim",
)
"""The public modules: ``partime`` (its ``__all__``) and the modules a user imports by name."""

SEAM = "partime.internals"
"""The one seam for measuring partime's parts apart (see its docstring)."""

REACHABLE = (*API, SEAM)


def _exported(name: str) -> set[str]:
    """What module ``name`` offers: its ``__all__``, else its public names that partime defines (not
    the names it imports from elsewhere, not its submodules); a package also offers its reachable
    submodules."""
    module = importlib.import_module(name)
    names = set(getattr(module, "__all__", ()))
    if not hasattr(module, "__all__"):
        names = {
            n
            for n, value in vars(module).items()
            if not n.startswith("_")
            and f"{name}.{n}" not in MODULES
            and str(getattr(value, "__module__", name)).split(".")[0] == "partime"
        }
    return names | {m.rpartition(".")[2] for m in REACHABLE if m.rpartition(".")[0] == name}


def _is_partime(module: str) -> bool:
    return module == "partime" or module.startswith("partime.")


def _taken(source: str) -> list[tuple[int, str, str]]:
    """(line, module, name) for everything ``source`` takes from partime: each name it imports from a
    partime module (``""`` for a whole module imported), each attribute it reads or writes on a
    partime module bound to a name, each ``getattr``/``setattr``/``hasattr``/``delattr`` of a literal
    name on one, and each partime module it imports by a literal string (``importlib.import_module``,
    ``__import__``). A step from a public package to a public submodule (``partime.sources`` off
    ``partime``) is not a name taken but the way to one."""
    tree = ast.parse(source)
    modules: dict[str, str] = {}  # name in the source -> the partime module it is bound to
    taken = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _is_partime(a.name):
                    taken.append((node.lineno, a.name, ""))
                    if a.asname:
                        modules[a.asname] = a.name
                    else:
                        modules["partime"] = "partime"
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_partime(node.module or ""):
            module = node.module or ""
            for a in node.names:
                taken.append((node.lineno, module, a.name))
                if f"{module}.{a.name}" in MODULES:
                    modules[a.asname or a.name] = f"{module}.{a.name}"

    def bound(node: ast.expr) -> str | None:
        """The partime module ``node`` stands for, where it is a name bound to one or a public
        submodule read off one."""
        if isinstance(node, ast.Name):
            return modules.get(node.id)
        if isinstance(node, ast.Attribute):
            parent = bound(node.value)
            if parent is not None and f"{parent}.{node.attr}" in REACHABLE:
                return f"{parent}.{node.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (module := bound(node.value)) and bound(node) is None:
            taken.append((node.lineno, module, node.attr))
        elif isinstance(node, ast.Call) and node.args:
            function = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
            literals = [a.value if isinstance(a, ast.Constant) and isinstance(a.value, str) else "" for a in node.args]
            module, name = bound(node.args[0]), (literals + [""])[1]
            if function in {"getattr", "setattr", "hasattr", "delattr"} and module and name:
                taken.append((node.lineno, module, name))
            if function in {"import_module", "__import__"} and _is_partime(literals[0]):
                taken.append((node.lineno, literals[0], ""))
    return sorted(taken)


def _beyond_the_api(taken: list[tuple[int, str, str]], offered: dict[str, set[str]]) -> list[str]:
    """``line: module.name`` for each thing taken from a module outside ``offered`` (the reachable
    modules and the names each offers), each name such a module does not offer, and each private
    name (a leading underscore, dunders aside)."""
    return [
        f"{line}: {module}{'.' if name else ''}{name}"
        for line, module, name in taken
        if module not in offered
        or (name and not (name.startswith("__") and name.endswith("__")) and name not in offered[module])
    ]


SAMPLE = """
import partime
import partime.core.stage as stage_module
from partime import Partition, Pipeline, internals, streams
from partime.internals import Channel, _hidden
from partime.planning.partition import split
from partime.sources import at_rate

pipe = partime.Pipeline(model, 2)
frames = partime.sources.at_rate(streams.moving_digits(8), 30.0)
stage_module.Stage
streams._digits
partime.core.stage
internals.newest(frames)
getattr(internals, "_POLL")
importlib.import_module("partime.executors.malloc")
print(partime.__version__)
"""


def test_the_api_checker_finds_what_reaches_beyond_the_api() -> None:
    offered = {
        "partime": {"Partition", "Pipeline", "internals", "sources", "streams"},
        "partime.sources": {"at_rate"},
        "partime.streams": {"moving_digits"},
        "partime.internals": {"Channel", "newest"},
    }
    assert _beyond_the_api(_taken(SAMPLE), offered) == [
        "3: partime.core.stage",
        "5: partime.internals._hidden",
        "6: partime.planning.partition.split",
        "11: partime.core.stage.Stage",
        "12: partime.streams._digits",
        "13: partime.core",
        "15: partime.internals._POLL",
        "16: partime.executors.malloc",
    ]
    assert {name for _, module, name in _taken(SAMPLE) if module == SEAM} == {"Channel", "_hidden", "newest", "_POLL"}


def _users() -> dict[str, list[tuple[int, str, str]]]:
    """What each file of the code around the package takes from partime, by file."""
    return {
        str(path.relative_to(ROOT)): _taken(path.read_text())
        for folder in USERS
        if folder.is_dir()
        for path in sorted(folder.rglob("*.py"))
    }


def test_the_tools_benchmarks_examples_and_experiments_reach_only_the_api_and_the_seam() -> None:
    users = _users()
    assert "src/partime_tools/bench/hop.py" in users and "benchmarks/torch_pipelining.py" in users
    assert [(m, n) for _, m, n in users["benchmarks/torch_pipelining.py"]] == [("partime", "Pipeline")]
    assert ("partime.internals", "Channel") in [(m, n) for _, m, n in users["src/partime_tools/bench/hop.py"]]
    offered = {name: _exported(name) for name in REACHABLE}
    assert "Channel" in offered[SEAM] and "Pipeline" in offered["partime"] and "write_video" in offered["partime.video"]
    beyond = [f"{path}:{found}" for path, taken in users.items() for found in _beyond_the_api(taken, offered)]
    assert beyond == []


def test_nothing_inside_the_package_imports_the_seam() -> None:
    assert SEAM in MODULES
    assert sorted(name for name, imported in _edges().items() if SEAM in imported) == []


def test_every_name_of_the_seam_has_a_user() -> None:
    seam = importlib.import_module(SEAM)
    used = {name for taken in _users().values() for _, module, name in taken if module == SEAM}
    assert "Channel" in used  # the bench's hop
    assert sorted(set(seam.__all__) - used) == []
    assert sorted(seam.__all__) == sorted(n for n in vars(seam) if not n.startswith("_"))  # it offers what it holds
