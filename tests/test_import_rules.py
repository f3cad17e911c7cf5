"""The allowed imports between omnirelay's packages (docs/DESIGN.md, "Allowed imports"), checked on
the source tree with ``ast``: every ``import``/``from … import`` of an ``omnirelay.*`` module in a
package's files, module-level or inside a function, must be one its package may use.

The layers, bottom up: the shared core (``omnirelay/*.py``: errors, security, lifecycle, request
parameter types, the block-hash contract, paths) imports none of the others; ``broker`` and
``connectors`` use only the core; ``workers`` and ``gateway`` use the core, the wire protocol and
the prefix-routing keys of ``broker``, and (workers) the connectors; ``deploy`` (launchers and model
builders) and ``omnirelay.fleet`` (planner, autoscaler) sit on top and may use the rest. Nothing below ``deploy`` imports it, except the modules
named in :data:`PENDING`, each a known debt with the reason it is still there.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent

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


def _imported_modules(tree: ast.AST, own_package: str) -> list[str]:
    out = []
    for node in ast.walk(tree):
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
        for module in _imported_modules(ast.parse(path.read_text(), str(path)), source):
            if not _allowed(source, module) and (rel, module) not in PENDING:
                found.append(f"{rel}: imports {module} ({source} may not use {_target_package(module)})")
    return found


def test_no_import_crosses_the_layers() -> None:
    assert violations() == []


def test_pending_debts_are_still_real() -> None:
    """A debt paid off leaves PENDING, so the list never hides a new violation of the same pair."""
    still = set()
    for rel, module in PENDING:
        path = ROOT / rel
        if path.is_file() and module in _imported_modules(ast.parse(path.read_text()), _package_of(path)):
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
