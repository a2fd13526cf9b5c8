"""The dependency direction eagle3 <- tasks <- flows, checked on every file's imports."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "eagle3": {"prefect", "mlflow", "paramiko", "yaml", "tasks", "flows", "typer"},
    "tasks": {"flows"},
}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def test_layering():
    violations = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((REPO / package).rglob("*.py")):
            bad = imported_modules(path) & forbidden
            violations += [f"{path.relative_to(REPO)} imports {name}" for name in sorted(bad)]
    assert violations == []


def test_the_check_can_fail(tmp_path):
    offender = tmp_path / "bad.py"
    offender.write_text("import mlflow\nfrom prefect import flow\n")
    assert imported_modules(offender) == {"mlflow", "prefect"}
