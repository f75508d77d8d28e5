"""The package's rooms import downwards only (docs/design.md, "Layers"): every module of
metalearn is read with ast and each of its metalearn imports must come from its own room or
one on a lower floor. The data sets stand below the engine: they build `Task`s (from the
foundations' `metalearn.task`) and never import the engine."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "metalearn"
FLOORS = {
    "functional": 1, "autograd": 1, "allocator": 1, "checkpoint": 1, "files": 1, "distributed": 1,
    "assignment": 1, "second_order": 1, "attention": 1, "debug": 1, "implicit": 1, "optim": 1,
    "task": 1, "normalisation": 1, "__init__": 1,
    "data": 2, "engine": 3, "models": 4, "rl": 4, "algorithms": 5, "runs": 6, "deploy": 7,
    "tools": 8,
}  # fmt: skip


def room(module: str) -> str:
    """``metalearn.engine.outer`` -> ``engine``; ``metalearn`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _is_module(name: str) -> bool:
    return (PACKAGE / f"{name}.py").is_file() or (PACKAGE / name).is_dir()


def imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            if node.module == "metalearn":  # from metalearn import distributed, ...: modules
                names |= {f"metalearn.{a.name}" for a in node.names if _is_module(a.name)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return {n for n in names if n == "metalearn" or n.startswith("metalearn.")}


def test_every_module_imports_its_own_room_or_lower():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert len(modules) > 60
    seen = set()
    for path in modules:
        name = ".".join(("metalearn", *path.relative_to(PACKAGE).with_suffix("").parts))
        own = room(name)
        seen.add(own)
        for imported in imports(path):
            if own == "__init__" and imported == "metalearn":
                continue
            other = room(imported)
            assert other in FLOORS, f"{name} imports {imported}: a room with no floor"
            assert FLOORS[other] <= FLOORS[own], (
                f"{name} (floor {FLOORS[own]}) imports "
                f"{imported} (floor {FLOORS[other]}): an import pointing up"
            )
    assert seen == set(FLOORS)  # every room has a floor, every floor a module


def test_the_engine_steps_go_down_in_order():
    order = ["inner", "plan", "outer", "accumulate", "compiled"]
    for i, step in enumerate(order):
        for imported in imports(PACKAGE / "engine" / f"{step}.py"):
            if imported.startswith("metalearn.engine."):
                assert order.index(imported.split(".")[2]) < i, (step, imported)


def test_the_data_sets_import_no_engine():
    data = sorted((PACKAGE / "data").rglob("*.py"))
    assert data and FLOORS["data"] < FLOORS["engine"]
    for path in data:
        engine = {n for n in imports(path) if room(n) == "engine"}
        assert not engine, f"{path.relative_to(PACKAGE)} imports {sorted(engine)}"
