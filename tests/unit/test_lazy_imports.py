"""`import pscluster` and each daemon's start-up load only what they use (a fresh interpreter per case)."""

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "jax", "ray", "tensorboardX", "mlxtend")


def loaded(module: str) -> list[str]:
    """The modules a fresh interpreter holds after importing `module`."""
    code = f"import json, sys; import {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return json.loads(out.stdout)


def test_import_pscluster_loads_nothing_of_its_own_until_a_name_is_used():
    mods = loaded("pscluster")
    assert [m for m in mods if m.startswith("pscluster")] == ["pscluster"]
    assert "numpy" not in mods and "grpc" not in mods


def test_a_ps_store_loads_only_the_api_codec_and_the_server_core():
    ours = {m for m in loaded("pscluster.server.store") if m.startswith("pscluster")}
    assert not {m for m in ours if m.startswith(("pscluster.client", "pscluster.net", "pscluster.ops",
                                                  "pscluster.coordinator", "pscluster.worker"))}
    assert len(ours) <= 24, sorted(ours)


# the bounds catch a stray import of a whole room, not one new module of the daemon's own job (the PS's
# bound grew by one for server/replica_wire.py, the compact replication batch every replicated push uses, and by
# one for server/replica_backup.py, replication's backup side split out of server/replication.py)
@pytest.mark.parametrize("daemon, never, bound", [
    ("pscluster.server.main", ("pscluster.client", "pscluster.coordinator", "pscluster.worker",
                               "pscluster.ops.launcher", "pscluster.ops.cli"), 57),
    ("pscluster.worker.main", ("pscluster.server", "pscluster.coordinator", "pscluster.ops.launcher"), 55),
    ("pscluster.coordinator.main", ("pscluster.server", "pscluster.worker", "pscluster.ops.launcher"), 65),
])
def test_each_daemon_imports_a_bounded_set_at_start_up(daemon, never, bound):
    mods = loaded(daemon)
    ours = [m for m in mods if m.startswith("pscluster")]
    assert [m for m in ours if m.startswith(never)] == []
    assert [m for m in mods if m.split(".")[0] in HEAVY] == []
    assert len(ours) <= bound, f"{daemon} loads {len(ours)} pscluster modules: {ours}"
