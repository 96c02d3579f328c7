"""Imports point one way: roles import the shared core, never each other, and the core imports no role.

The entry points (the public `pscluster` namespace, the CLI and the launchers) compose roles into
programs, so they alone may import any of them. Imports inside functions count too.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROLES = {"server": "pscluster.server", "worker": "pscluster.worker", "coordinator": "pscluster.coordinator"}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _role_of(module: str) -> str | None:
    return next((role for role, pkg in ROLES.items() if module == pkg or module.startswith(pkg + ".")), None)


def _violations(folder: str, allowed: set[str], root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted((root / folder).rglob("*.py")):
        if folder == "pscluster" and (path.parent == root / "pscluster" / "ops" or path == root / "pscluster" / "__init__.py"):
            continue
        for line, module in _imports(path):
            role = _role_of(module)
            if role is not None and role not in allowed:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return sorted(set(bad))


@pytest.mark.parametrize("folder", ["pscluster", "server", "worker", "coordinator"])
def test_imports_point_one_way(folder):
    allowed = {folder} if folder in ROLES else set()
    assert _violations(folder, allowed) == []


def test_the_check_sees_a_violation(tmp_path):
    fake = tmp_path / "worker"
    fake.mkdir()
    (fake / "bad.py").write_text("def f():\n    from pscluster.coordinator.scheduler import x\n")
    assert _violations("worker", {"worker"}, tmp_path) == ["worker/bad.py:2 imports pscluster.coordinator.scheduler",
                                                 "worker/bad.py:2 imports pscluster.coordinator.scheduler.x"]
