"""The house's rules, checked on every file's imports (lazy ones inside functions included).

- The direction eagle3 <- tasks <- flows, and no orchestration library inside eagle3/.
- Inside eagle3/, the wings from the bottom up: config/environment, draft, data, training,
  export, serving, then the commands (`python -m eagle3.serve`, `python -m eagle3.torchrun`, the fork server).
- Inside tasks/, the wings from the bottom up: config, then the run log and the run folder
  (`tasks.log`, `tasks.rundir`, `tasks.run_lock`), hosts, tracking, watch, runner, stages.
- The watch's decisions (`tasks/watch/rules.py`) import no outside world at all.
  A module may import its own wing and the wings below it, never one above.
- No circular import anywhere in eagle3, tasks and flows.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "eagle3": {"prefect", "mlflow", "paramiko", "yaml", "tasks", "flows", "typer"},
    "tasks": {"flows"},
}
# Modules of pure decisions: no orchestration, tracking or I/O library, so they are judged on figures alone.
PURE_MODULES = {"tasks/watch/rules.py": {"prefect", "mlflow", "httpx", "requests", "paramiko", "eagle3", "flows"}}
# Wings, bottom first; a module's wing is the one whose prefix its dotted name starts with
EAGLE3_WINGS = [
    ("eagle3.config", "eagle3.environment", "eagle3.figures"),
    ("eagle3.draft",),
    ("eagle3.data",),
    ("eagle3.training",),
    ("eagle3.export",),
    ("eagle3.serving",),
    ("eagle3.serve", "eagle3.torchrun", "eagle3.forkserver"),
]
TASKS_WINGS = [
    ("tasks.config",),
    ("tasks.log", "tasks.rundir", "tasks.run_lock"),
    ("tasks.hosts",),
    ("tasks.tracking",),
    ("tasks.watch",),
    ("tasks.runner",),
    ("tasks.stages",),
]
WINGS = {"eagle3": EAGLE3_WINGS, "tasks": TASKS_WINGS}


def imported_modules(path: Path) -> set[str]:
    """Top-level package names a file imports."""
    return {name.split(".")[0] for name in imported_names(path)}


def imported_names(path: Path) -> set[str]:
    """Dotted module names a file imports, anywhere in it (`from a.b import c` -> a.b and a.b.c)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def wing_of(module: str) -> int | None:
    """Index in its package's wings of the wing `module` belongs to (None: not a module of a wing)."""
    for level, prefixes in enumerate(WINGS.get(module.split(".")[0], [])):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def package_modules(*packages: str) -> dict[str, Path]:
    return {module_name(p): p for package in packages for p in sorted((REPO / package).rglob("*.py"))}


def eagle3_modules() -> dict[str, Path]:
    return package_modules("eagle3")


def tasks_modules() -> dict[str, Path]:
    return package_modules("tasks")


def wing_violations(modules: dict[str, Path]) -> list[str]:
    """`a imports b` for every import inside one package (eagle3, tasks) that points up its wings."""
    violations = []
    for name, path in modules.items():
        package, own = name.split(".")[0], wing_of(name)
        wings = WINGS.get(package, [])
        for target in sorted(imported_names(path)):
            level = wing_of(target)
            if target.startswith(package + ".") and level is not None and own is not None and level > own:
                violations.append(f"{name} imports {target} (wing {wings[level][0]} is above {wings[own][0]})")
    return violations


def import_cycles(modules: dict[str, Path]) -> list[list[str]]:
    """Cycles of the import graph between the modules given (each cycle once, from its smallest name).

    `from pkg import name` counts as an import of `pkg.name` when that is a module, else of `pkg`, so a
    package `__init__` that re-exports from a module which imports the package back is a cycle too.
    """
    graph = {name: sorted({_known_module(t, modules) for t in imported_names(path)} - {None, name})
             for name, path in modules.items()}
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):]
                start = cycle.index(min(cycle))
                cycles.append(cycle[start:] + cycle[:start])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for name in graph:
        if name not in state:
            visit(name, [])
    return cycles


def _known_module(dotted: str, modules: dict[str, Path]) -> str | None:
    """The module of `modules` a dotted import name lands in (`a.b.c` -> `a.b` when c is a name in it)."""
    while dotted and dotted not in modules:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def test_layering():
    violations = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((REPO / package).rglob("*.py")):
            bad = imported_modules(path) & forbidden
            violations += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(bad)]
    assert violations == []


def test_pure_modules_import_no_outside_world():
    found = {path: sorted(imported_modules(REPO / path) & banned) for path, banned in PURE_MODULES.items()}
    assert {path: names for path, names in found.items() if names} == {}


def test_every_eagle3_module_is_in_a_wing():
    assert [name for name in eagle3_modules() if name != "eagle3" and wing_of(name) is None] == []


def test_wings_only_import_wings_below_them():
    assert wing_violations(eagle3_modules()) == []


def test_no_circular_import_in_eagle3():
    assert import_cycles(eagle3_modules()) == []


def test_every_tasks_module_is_in_a_wing():
    assert [name for name in tasks_modules() if name != "tasks" and wing_of(name) is None] == []


def test_tasks_wings_only_import_wings_below_them():
    assert wing_violations(tasks_modules()) == []


def test_no_circular_import_anywhere():
    assert import_cycles(package_modules("eagle3", "tasks", "flows")) == []


def test_the_checks_can_fail(tmp_path):
    offender = tmp_path / "bad.py"
    offender.write_text("import mlflow\nfrom prefect import flow\n")
    assert imported_modules(offender) == {"mlflow", "prefect"}

    draft = tmp_path / "draft.py"
    draft.write_text("def f():\n    from eagle3.serving.decoding import SpecConfig\n")
    data = tmp_path / "data.py"
    data.write_text("from eagle3.draft.vocab import load_draft_vocab\n")
    assert wing_violations({"eagle3.draft.x": draft, "eagle3.data.y": data}) == [
        "eagle3.draft.x imports eagle3.serving.decoding (wing eagle3.serving is above eagle3.draft)",
        "eagle3.draft.x imports eagle3.serving.decoding.SpecConfig (wing eagle3.serving is above eagle3.draft)",
    ]

    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("import eagle3.data.b\n")
    b.write_text("def g():\n    from eagle3.data import a\n")
    assert import_cycles({"eagle3.data.a": a, "eagle3.data.b": b}) == [["eagle3.data.a", "eagle3.data.b"]]

    # tasks/: a planted upward import (tracking -> runner) and a planted circle between two wings' modules
    tracking, runner = tmp_path / "tracking.py", tmp_path / "runner.py"
    tracking.write_text("from tasks.runner.context import StageContext\n")
    runner.write_text("import tasks.tracking.run_logger\n")
    planted = {"tasks.tracking.run_logger": tracking, "tasks.runner.context": runner}
    assert wing_violations(planted) == [
        "tasks.tracking.run_logger imports tasks.runner.context (wing tasks.runner is above tasks.tracking)",
        "tasks.tracking.run_logger imports tasks.runner.context.StageContext (wing tasks.runner is above tasks.tracking)",
    ]
    assert import_cycles(planted) == [["tasks.runner.context", "tasks.tracking.run_logger"]]
    assert wing_of("tasks.somewhere_new") is None  # a module outside every wing fails the every-module test

    # a package that re-exports from a module which imports the package back
    init, sub = tmp_path / "__init__.py", tmp_path / "sub.py"
    init.write_text("from tasks.hosts.remote.sub import helper\n")
    sub.write_text("from tasks.hosts.remote import other\n")
    assert import_cycles({"tasks.hosts.remote": init, "tasks.hosts.remote.sub": sub}) == [
        ["tasks.hosts.remote", "tasks.hosts.remote.sub"]]
