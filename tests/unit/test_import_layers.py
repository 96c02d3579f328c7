"""Imports point one way, room by room, and no files import each other in a circle.

    api (pscluster/*.py) <- net <- client <- adapters (torch, jax)
                             \\        \\
                              server   worker, coordinator      <- ops (entry points: may import anything)

The roles' `main` modules start daemons with two pieces of ops (`daemon`, `metrics`); nothing else of ops
is imported below it. Imports inside functions and under `if TYPE_CHECKING:` count too.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"pscluster.server": "server", "pscluster.worker": "worker", "pscluster.coordinator": "coordinator",
           "pscluster.proto": "proto"}
DAEMON_PLUMBING = {"ops.daemon", "ops.metrics"}
# room -> the rooms it may import (itself included)
ALLOWED = {
    "api": {"api", "proto"},
    "proto": {"proto"},
    "net": {"api", "proto", "net"},
    "client": {"api", "proto", "net", "client"},
    "adapters": {"api", "proto", "net", "client", "adapters"},
    "server": {"api", "proto", "net", "server"} | DAEMON_PLUMBING,
    "worker": {"api", "proto", "net", "client", "worker"} | DAEMON_PLUMBING,
    "coordinator": {"api", "proto", "net", "client", "coordinator"} | DAEMON_PLUMBING,
}


def room_of(module: str) -> str | None:
    """The room of a pscluster module name (None outside pscluster; 'ops.x' for ops modules)."""
    parts = module.split(".")
    if parts[0] != "pscluster":
        return None
    if len(parts) == 1:
        return "root"
    head = parts[1]
    if head in ("server", "worker", "coordinator", "proto", "net", "client"):
        return head
    if head in ("torch", "jax"):
        return "adapters"
    if head == "ops":
        return "ops." + parts[2] if len(parts) > 2 else "ops"
    return "api"


def module_of(path: Path, root: Path = ROOT) -> str:
    """The dotted name a repository file is installed as."""
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    for package, folder in FOLDERS.items():
        if parts[0] == folder:
            parts = package.split(".") + parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every absolute import in a file: `from a import b` counts as a.b when b is a
    module, else as a (the caller cannot tell which without the tree, so both are listed; see below)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def edges_of(path: Path, known: set[str]) -> set[str]:
    """The project modules a file needs: `from pkg import mod` needs pkg.mod, not pkg's own __init__."""
    deps = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            targets = [s for s in subs if s in known]
            if len(targets) < len(subs):
                targets.append(node.module)  # some names are attributes of the module itself
        else:
            continue
        for module in targets:
            while module and module not in known:
                module = module.rpartition(".")[0]
            if module:
                deps.add(module)
    return deps


def project_files(root: Path = ROOT) -> list[Path]:
    """Every installed source file (generated stubs aside)."""
    files = []
    for folder in ["pscluster", *FOLDERS.values()]:
        files += [p for p in (root / folder).rglob("*.py") if "_pb2" not in p.name]
    return sorted(files)


def violations(root: Path = ROOT) -> list[str]:
    """'file:line imports module (room -> room)' for every import that points the wrong way."""
    bad = []
    for path in project_files(root):
        mine = room_of(module_of(path, root))
        if mine is None or mine == "root" or mine.startswith("ops"):
            continue  # the lazy public namespace and the entry points compose everything
        for line, module in imports_of(path):
            theirs = room_of(module)
            if theirs is None or theirs in ("root", "ops"):
                continue  # the lazy namespace and ops/__init__ (a docstring) import nothing
            if theirs.startswith("ops") and theirs in ALLOWED[mine]:
                continue
            if theirs.split(".")[0] not in ALLOWED[mine] or theirs.startswith("ops"):
                bad.append(f"{path.relative_to(root)}:{line} imports {module} ({mine} -> {theirs})")
    return sorted(set(bad))


def circles(root: Path = ROOT) -> list[list[str]]:
    """Strongly connected groups of more than one project module (files that import each other)."""
    names = {module_of(p, root): p for p in project_files(root)}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        graph[name] = edges_of(path, set(names)) - {name}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_imports_point_one_way():
    assert violations() == []


def test_no_files_import_each_other_in_a_circle():
    # package __init__ files count as their package: pscluster/__init__ imports lazily, so no edge
    assert circles() == []


@pytest.mark.parametrize("room, source, expected", [
    ("server", "from pscluster.client.client import PSClient\n", "server -> client"),
    ("worker", "def f():\n    from pscluster.coordinator.scheduler import x\n", "worker -> coordinator"),
    ("coordinator", "from pscluster.worker import runner\n", "coordinator -> worker"),
    ("pscluster/net", "from pscluster.client import context\n", "net -> client"),
    ("pscluster/client", "from pscluster.server.store import VariableStore\n", "client -> server"),
    ("pscluster", "from pscluster.net import rpc\n", "api -> net"),
    ("server", "from pscluster.ops.launcher import LocalCluster\n", "server -> ops.launcher"),
])
def test_the_check_sees_a_violation(tmp_path, room, source, expected):
    folder = tmp_path / room
    folder.mkdir(parents=True)
    for name in ("pscluster", *FOLDERS.values()):
        (tmp_path / name).mkdir(exist_ok=True)
    (folder / "bad.py").write_text(source)
    found = violations(tmp_path)
    assert len(found) >= 1 and all(expected in v for v in found), found


def test_the_check_sees_a_circle(tmp_path):
    for name in ("pscluster", *FOLDERS.values()):
        (tmp_path / name).mkdir()
    (tmp_path / "server" / "a.py").write_text("from pscluster.server import b\n")
    (tmp_path / "server" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from pscluster.server.a import x\n")
    assert circles(tmp_path) == [["pscluster.server.a", "pscluster.server.b"]]
