"""examples/tutorial_mnist.py killed with SIGKILL mid-epoch resumes, when run again, at the epoch and step of
the newest automatic checkpoint, with its callbacks' state, and ends in the accuracy band of a whole run."""

import os
import pathlib
import re
import signal
import subprocess
import sys
import time

import pytest

from pscluster.checkpoint_files import complete_steps

pytestmark = pytest.mark.cluster
EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "tutorial_mnist.py"
SPE = 8


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _args(backup: pathlib.Path) -> list[str]:
    return [sys.executable, str(EXAMPLE), "--epochs", "3", "--steps-per-epoch", str(SPE), "--backup-dir", str(backup),
            "--checkpoint-every-steps", "2", "--verbose", "2", "--min-accuracy", "0"]


def _stop(program: subprocess.Popen, daemons: list[int]) -> None:
    """SIGKILL the program, then wait for its daemons to stop (they exit with their parent); kill any left."""
    if program.poll() is None:
        os.kill(program.pid, signal.SIGKILL)
    program.wait(timeout=10)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in daemons) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in daemons:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(240)
def test_tutorial_killed_mid_epoch_resumes_at_the_checkpointed_step_with_its_callbacks(tmp_path):
    backup = tmp_path / "backup"
    program = subprocess.Popen(_args(backup), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    daemons: list[int] = []
    first = []
    try:
        for line in program.stdout:
            first.append(line)
            if line.startswith("daemons:"):
                daemons = [int(p) for p in line.split()[1:]]
            if line.startswith("Epoch 1/3:"):
                break
        assert len(daemons) == 4, "".join(first)
        deadline = time.monotonic() + 60
        while not any(SPE < step < 2 * SPE for step, _ in complete_steps(backup / "ps")):
            assert time.monotonic() < deadline and program.poll() is None, "".join(first)
            time.sleep(0.02)
    finally:
        _stop(program, daemons)
        program.stdout.close()
    killed_at = max(step for step, _ in complete_steps(backup / "ps"))
    assert SPE < killed_at < 3 * SPE, "".join(first)  # mid-run, after epoch 1's callbacks ran

    out = subprocess.run(_args(backup), capture_output=True, text=True, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    resumed = re.search(r"restored global step (\d+) \((\d+) closures\): resuming at epoch (\d+), step (\d+)", text)
    assert resumed, text
    step, closures, epoch, in_epoch = (int(g) for g in resumed.groups())
    assert step == closures == killed_at and (epoch - 1) * SPE + in_epoch == step, text  # async: G counts closures
    assert "Epoch 1/3:" not in text and "Epoch 3/3:" in text, text  # epoch 1 is not run again
    # the callbacks' state came back: ModelCheckpoint wrote epoch 1's file before the kill, the rerun the others
    assert sorted(p.name for p in (backup / "weights").iterdir()) == [f"ckpt_{e}.safetensors" for e in (1, 2, 3)]
    acc = float(re.search(r"held-out test accuracy: ([0-9.]+)", text).group(1))
    # Well above chance (0.1): a resume that restored garbage ends near it. Resuming costs no accuracy: the
    # restored PS state is the checkpoint's bit for bit (values, Adam m and v, update counts, learning rate: the
    # next update equals the uninterrupted cluster's: test_restore_state), and the rerun draws past the batches the
    # restored closures trained on (test_fit_loop; replaying them cost 0.020 +- 0.008 in single-process torch,
    # 40 paired seeds).
    # What varies is 24 asynchronous steps on the steep part of the curve, resumed or not. On 2 cores shared at
    # load 4-27 (2026-11-26): 9 uninterrupted runs 0.378-0.774 (median 0.52; 4 more failed: closures lost their
    # heartbeat-starved workers 10 times), 10 resumed before the data fix 0.419-0.703 (median 0.595), 10 after
    # it 0.324-0.678 (median 0.54; 1 more ended without an accuracy, its output not kept); a resumed run applies
    # 1-3 updates more (the checkpoint labelled G holds up to G + 3). 3 x 16 steps narrows little (0.54-0.78
    # over 8 runs) and took 178 s instead of 66 s here.
    assert acc >= 0.25, text
