"""The core package imports neither the gateway nor the services: they import it (the
layering the README's layout table states). A scan of every import in ``lyanna/``."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "lyanna"
UPPER = ("gateway", "services", "bench", "training", "tests")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_core_imports_nothing_above_it() -> None:
    upward = {
        f"{path.relative_to(CORE.parent)}: {name}"
        for path in CORE.rglob("*.py")
        for name in imported_modules(path)
        if name.split(".")[0] in UPPER
    }
    assert not upward, sorted(upward)
    assert len(list(CORE.rglob("*.py"))) > 20  # the scan saw the package
