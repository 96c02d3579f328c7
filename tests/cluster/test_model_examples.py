"""The PyTorch and JAX examples run as a user runs them, and reach their quality bars."""

import pathlib
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.cluster
EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def run_example(name, *args, timeout=240):
    out = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode in (0, 1), out.stdout + out.stderr  # 1: below the bar, reported by the asserts below
    return out.stdout + out.stderr


def test_torch_mnist_cnn_reaches_095_held_out_accuracy_on_2_ps_and_2_workers():
    out = run_example("torch_mnist.py", "--steps", "1000", "--ps", "2", "--workers", "2", "--min-accuracy", "0")
    assert "cluster: 2 PS, 2 workers" in out, out
    acc = float(re.search(r"held-out test accuracy: ([0-9.]+)", out).group(1))
    assert acc >= 0.95, out


def test_torch_recsys_with_two_1m_row_tables_reaches_auc_060():
    out = run_example("torch_recsys.py", "--steps", "1000", "--rows", "1000000", "--min-auc", "0")
    assert "tables: 2 x 1,000,000 rows" in out, out
    score = float(re.search(r"held-out AUC: ([0-9.]+)", out).group(1))
    assert score >= 0.6, out


def test_torch_recsys_hashed_reports_auc_and_the_live_table_size_as_it_trains():
    """--hashed on small flags: dynamic tables grow, evict idle keys, and the model still learns."""
    out = run_example("torch_recsys.py", "--hashed", "--steps", "60", "--rows", "3000", "--batch", "256",
                      "--workers", "1", "--eval-samples", "2000", "--max-idle", "10", "--min-auc", "0", timeout=120)
    rounds = re.findall(r"after (\d+) steps: live keys user ([\d,]+), item ([\d,]+); evicted ([\d,]+)", out)
    assert [int(r[0]) for r in rounds] == [12, 24, 36, 48, 60], out
    live = [(int(u.replace(",", "")), int(i.replace(",", ""))) for _, u, i, _ in rounds]
    assert all(u > 0 and i > 0 for u, i in live) and live[1][0] > live[0][0], out  # rows appear as keys are admitted
    assert int(rounds[-1][3].replace(",", "")) > 0, out  # rows idle for 10 pushes were evicted by the sweep
    per_round = [float(a) for a in re.findall(r"; held-out AUC ([0-9.]+)", out)]
    assert len(per_round) == 5, out  # the AUC over time, beside the table's size
    score = float(re.search(r"held-out AUC: ([0-9.]+)", out).group(1))
    assert score >= 0.6 and score == per_round[-1], out


def test_jax_mnist_mlp_trains_on_2_ps_and_2_workers():
    out = run_example("jax_mnist.py", "--steps", "1000", "--ps", "2", "--workers", "2", "--min-accuracy", "0")
    assert "cluster: 2 PS, 2 workers" in out, out
    losses = re.search(r"loss ([0-9.]+) -> ([0-9.]+)", out)
    assert float(losses.group(2)) < float(losses.group(1)) / 4, out
    acc = float(re.search(r"held-out test accuracy: ([0-9.]+)", out).group(1))
    assert acc >= 0.92, out
