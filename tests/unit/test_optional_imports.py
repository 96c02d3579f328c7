"""The model adapters are optional extras: the core never imports torch or jax."""

import subprocess
import sys

import pytest

CORE = ("pscluster", "pscluster.client.client", "pscluster.ops.launcher", "pscluster.coordinator.coordinator",
        "pscluster.server.main", "pscluster.worker.main", "pscluster.ops.cli")


@pytest.mark.parametrize("framework", [("torch",), ("jax", "jaxlib")], ids=["torch", "jax"])
def test_core_modules_never_import_a_model_framework(framework):
    code = (f"import sys, {', '.join(CORE)}; assert pscluster.ClusterCoordinator; "
            f"print(sorted(m for m in sys.modules if m.split('.')[0] in {framework!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
