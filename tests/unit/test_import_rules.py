"""The allowed imports between omnirelay's packages (docs/DESIGN.md, "Allowed imports"), checked on
the source tree with ``ast``: every ``import``/``from … import`` of an ``omnirelay.*`` module in a
package's files, module-level or inside a function, must be one its package may use.

The layers, bottom up: the shared core (``omnirelay/*.py``: errors, security, lifecycle, request
parameter types, the block-hash contract, paths) imports none of the others; ``broker`` and
``connectors`` use only the core; ``workers`` and ``gateway`` use the core, the wire protocol and
the prefix-routing keys of ``broker``, and (workers) the connectors; ``deploy`` (launchers and model
builders) and ``omnirelay.fleet`` (planner, autoscaler) sit on top and may use the rest. Nothing below ``deploy`` imports it, except the modules
named in :data:`PENDING`, each a known debt with the reason it is still there.

Inside ``workers``, ``runtime`` (the socket loop, the broker link, config) is the bottom layer: it
imports none of the engine subpackages (:data:`SUBPACKAGE_RULES`). And no two modules import each
other, directly or round a longer loop, at module level (imports inside functions run later and do
not count; nor do ``if TYPE_CHECKING:`` blocks), nor do two subpackages. The known exceptions are
listed by name in :data:`KNOWN_SUBPACKAGE_DEBTS`, :data:`KNOWN_CYCLES` and
:data:`KNOWN_SUBPACKAGE_CYCLES` (issue #28), so the test fails on any new one. Relative imports are
resolved from the file's own package.
"""

from __future__ import annotations

import ast
import pathlib
from repo_paths import REPO_ROOT

ROOT = REPO_ROOT

# Source folder → the package it is installed as (pyproject's package-dir).
FOLDERS = {"broker": "omnirelay.broker", "connectors": "omnirelay.connectors", "gateway": "omnirelay.gateway",
           "workers": "omnirelay.workers", "deploy": "omnirelay.deploy", "omnirelay/bench": "omnirelay.bench",
           "omnirelay/fleet": "omnirelay.fleet"}
CORE = "omnirelay"   # omnirelay/*.py, the shared core

WIRE = ("omnirelay.broker.protocol", "omnirelay.broker.prefix_index")
ALLOWED: dict[str, tuple[str, ...]] = {
    CORE: (),
    "omnirelay.bench": (),
    "omnirelay.broker": (),
    "omnirelay.connectors": (),
    "omnirelay.workers": WIRE + ("omnirelay.connectors",),
    "omnirelay.gateway": WIRE,
    "omnirelay.deploy": ("omnirelay.broker", "omnirelay.connectors", "omnirelay.gateway", "omnirelay.workers",
                         "omnirelay.bench", "omnirelay.fleet"),
    # The planner and autoscaler operate a deployment: they launch and drain what deploy starts.
    "omnirelay.fleet": ("omnirelay.broker", "omnirelay.gateway", "omnirelay.deploy", "omnirelay.bench"),
}

# (importing file, imported module): debts, each to be paid by moving the shared piece into the core.
PENDING: set[tuple[str, str]] = set()

# A subpackage → the subpackages it may not import (anywhere in a module, functions included).
_ENGINES = ("omnirelay.workers.llm", "omnirelay.workers.kv", "omnirelay.workers.encode",
            "omnirelay.workers.generate", "omnirelay.workers.speech")
SUBPACKAGE_RULES: dict[str, tuple[str, ...]] = {"omnirelay.workers.runtime": _ENGINES}

# (importing file, imported module) pairs that break SUBPACKAGE_RULES, each still real
# (test_known_debts_are_still_real): none since issue #28 moved the LLM adapters and parallel group
# to llm/ and the engines' checks of a worker's config to the role table.
KNOWN_SUBPACKAGE_DEBTS: set[tuple[str, str]] = set()

# Module-level import cycles known today, each a sorted tuple of its modules (one strongly connected
# set of the module-level import graph): none.
KNOWN_CYCLES: set[tuple[str, ...]] = set()

# The same graph folded to subpackages (omnirelay.workers.llm …): no loop since the LLM role
# adapters and parallel group moved from runtime/ to llm/ (issue #28).
KNOWN_SUBPACKAGE_CYCLES: set[tuple[str, ...]] = set()


def _package_of(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT).as_posix()
    for folder, package in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        if rel.startswith(folder + "/"):
            return package
    return CORE


def _module_exists(dotted: str) -> bool:
    """Whether ``dotted`` (an ``omnirelay.*`` name) is a module or package in this tree."""
    parts = dotted.split(".")[1:]
    if not parts:
        return True
    for folder, package in FOLDERS.items():
        head = package.split(".")[1:]
        if parts[:len(head)] == head:
            base = ROOT / folder / pathlib.Path(*parts[len(head):]) if parts[len(head):] else ROOT / folder
            return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()
    base = ROOT / "omnirelay" / pathlib.Path(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _module_name(path: pathlib.Path) -> str:
    """The dotted name ``path`` is installed as (``workers/runtime/loop.py`` → ``omnirelay.workers.runtime.loop``)."""
    rel = path.relative_to(ROOT).with_suffix("")
    for folder, package in sorted(FOLDERS.items(), key=lambda kv: -len(kv[0])):
        if rel.as_posix().startswith(folder + "/"):
            parts = package.split(".") + list(rel.relative_to(folder).parts)
            break
    else:
        parts = list(rel.parts)   # omnirelay/x.py
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _file_package(path: pathlib.Path) -> str:
    """The package relative imports in ``path`` start from: itself for an ``__init__.py``, else its parent."""
    name = _module_name(path)
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _module_level(tree: ast.Module) -> list[ast.stmt]:
    """The statements that run when the module is imported: its body, into ``if``/``try``/``with``
    blocks and class bodies, not into functions nor ``if TYPE_CHECKING:`` blocks."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo += node.orelse
            continue
        out.append(node)
        for field in ("body", "orelse", "finalbody", "handlers"):
            todo += [n for n in getattr(node, field, []) if isinstance(n, (ast.stmt, ast.excepthandler))]
    return out


def _imported_modules(tree: ast.AST, own_package: str, nodes: list[ast.AST] | None = None) -> list[str]:
    """The ``omnirelay.*`` modules imported anywhere in ``tree`` (or by ``nodes`` only); relative
    imports start from ``own_package``, the package the file is in."""
    out = []
    for node in ast.walk(tree) if nodes is None else nodes:
        if isinstance(node, ast.Import):
            out += [alias.name for alias in node.names if alias.name.startswith("omnirelay")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = own_package.split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if not module.startswith("omnirelay"):
                continue
            # `from omnirelay.broker import protocol` imports the submodule omnirelay.broker.protocol.
            subs = [f"{module}.{alias.name}" for alias in node.names if _module_exists(f"{module}.{alias.name}")]
            out += subs or [module]
    return out


def _target_package(module: str) -> str:
    for package in sorted(set(FOLDERS.values()), key=len, reverse=True):
        if module == package or module.startswith(package + "."):
            return package
    return CORE


def _subpackage_of(dotted: str) -> str:
    """``omnirelay.workers.runtime.loop`` → ``omnirelay.workers.runtime`` (the rule keys' depth)."""
    return ".".join(dotted.split(".")[:3])


def _allowed(source: str, module: str) -> bool:
    target = _target_package(module)
    if target == source or target == CORE:
        return True
    return any(module == rule or module.startswith(rule + ".") for rule in ALLOWED[source])


def violations() -> list[str]:
    found = []
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    files += list((ROOT / "omnirelay").glob("*.py"))
    for path in sorted(set(files)):
        source = _package_of(path)
        rel = path.relative_to(ROOT).as_posix()
        for module in _imported_modules(ast.parse(path.read_text(), str(path)), _file_package(path)):
            if not _allowed(source, module) and (rel, module) not in PENDING:
                found.append(f"{rel}: imports {module} ({source} may not use {_target_package(module)})")
    return found


def _source_files() -> list[pathlib.Path]:
    files = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py")]
    return sorted(set(files + list((ROOT / "omnirelay").glob("*.py"))))


def subpackage_violations() -> set[tuple[str, str]]:
    """(file, module) pairs where a subpackage of :data:`SUBPACKAGE_RULES` imports one it may not."""
    found = set()
    for path in _source_files():
        forbidden = SUBPACKAGE_RULES.get(_subpackage_of(_module_name(path)), ())
        if not forbidden:
            continue
        for module in _imported_modules(ast.parse(path.read_text(), str(path)), _file_package(path)):
            if any(module == rule or module.startswith(rule + ".") for rule in forbidden):
                found.add((path.relative_to(ROOT).as_posix(), module))
    return found


def module_graph() -> dict[str, set[str]]:
    """Module → the modules its import runs at once: its module-level imports, each with the
    packages above it (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first) — except
    the packages above the importer itself, which have started before it and never run again."""
    graph: dict[str, set[str]] = {}
    for path in _source_files():
        tree = ast.parse(path.read_text(), str(path))
        name = _module_name(path)
        own = name.split(".")
        ancestors = {".".join(own[:i]) for i in range(1, len(own))}
        edges = set()
        for module in _imported_modules(tree, _file_package(path), _module_level(tree)):
            parts = module.split(".")
            edges |= {".".join(parts[:i]) for i in range(2, len(parts))} - ancestors
            edges.add(module)
        graph[name] = {m for m in edges if m != name and _module_exists(m)}
    return graph


def subpackage_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` folded to subpackages (:func:`_subpackage_of`), without edges inside one."""
    folded: dict[str, set[str]] = {}
    for module, imports in graph.items():
        source = _subpackage_of(module)
        folded.setdefault(source, set()).update(t for t in map(_subpackage_of, imports) if t != source)
    return folded


def import_cycles(graph: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    cycles.add(tuple(sorted(members)))
    return cycles


def test_no_import_crosses_the_layers() -> None:
    assert violations() == []


def test_runtime_imports_no_engine_subpackage() -> None:
    """``workers/runtime`` is the workers' bottom layer: beyond the named debts, nothing in it
    imports ``llm``, ``kv``, ``encode``, ``generate`` or ``speech``."""
    assert sorted(subpackage_violations() - KNOWN_SUBPACKAGE_DEBTS) == []


def test_no_module_level_import_cycle() -> None:
    assert sorted(import_cycles(module_graph()) - KNOWN_CYCLES) == []


def test_no_subpackage_import_cycle() -> None:
    assert sorted(import_cycles(subpackage_graph(module_graph())) - KNOWN_SUBPACKAGE_CYCLES) == []


def test_known_debts_are_still_real() -> None:
    """A debt paid off leaves its list, so the list never hides a new violation of the same kind."""
    assert KNOWN_SUBPACKAGE_DEBTS <= subpackage_violations()
    assert KNOWN_CYCLES <= import_cycles(module_graph())
    assert KNOWN_SUBPACKAGE_CYCLES <= import_cycles(subpackage_graph(module_graph()))


def test_the_cycle_finder_sees_a_loop_and_not_a_chain() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_cycles(graph) == {("a", "b", "c")}
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == set()


def test_module_level_imports_skip_functions_and_type_checking(tmp_path: pathlib.Path) -> None:
    tree = ast.parse("import omnirelay.errors\nif TYPE_CHECKING:\n    import omnirelay.paths\n"
                     "try:\n    from omnirelay import security\nexcept ImportError:\n    pass\n"
                     "def f():\n    import omnirelay.tracing\n")
    assert sorted(_imported_modules(tree, "omnirelay", _module_level(tree))) == [
        "omnirelay.errors", "omnirelay.security"]


def test_relative_imports_start_from_the_files_own_package() -> None:
    path = ROOT / "gateway" / "routes" / "service.py"
    assert _module_name(path) == "omnirelay.gateway.routes.service"
    tree = ast.parse("from ..app_keys import BUS\nfrom . import images\n")
    assert _imported_modules(tree, _file_package(path)) == ["omnirelay.gateway.app_keys",
                                                            "omnirelay.gateway.routes.images"]


def test_pending_debts_are_still_real() -> None:
    """A debt paid off leaves PENDING, so the list never hides a new violation of the same pair."""
    still = set()
    for rel, module in PENDING:
        path = ROOT / rel
        if path.is_file() and module in _imported_modules(ast.parse(path.read_text()), _file_package(path)):
            still.add((rel, module))
    assert still == PENDING


def test_the_checker_sees_a_violation(tmp_path: pathlib.Path) -> None:
    """The rule engine itself: a broker module importing a worker module is reported."""
    tree = ast.parse("from omnirelay.workers.kv import cache\nimport omnirelay.gateway.app\n")
    modules = _imported_modules(tree, "omnirelay.broker")
    assert modules == ["omnirelay.workers.kv.cache", "omnirelay.gateway.app"]
    assert not any(_allowed("omnirelay.broker", m) for m in modules)
    assert _allowed("omnirelay.workers", "omnirelay.broker.protocol")
    assert not _allowed("omnirelay.workers", "omnirelay.broker.core")
