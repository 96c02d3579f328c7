"""fit with BackupAndRestore, its driver program SIGKILLed mid-epoch in sync mode: the rerun resumes at the exact
closure the restored checkpoint holds (R closures per global step), and the run ends with every closure applied
once. (Bounded mode counts one closure per global step, as async does: tests/unit/test_fit_loop.py.)"""

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

from pscluster.checkpoint_files import complete_steps
from tests.cluster.test_tutorial_resume import _stop

pytestmark = pytest.mark.cluster
PROGRAM = pathlib.Path(__file__).resolve().parent / "fit_program.py"
GATE_STEP = 5  # global step 5 (closures 10 and 11) waits
EPOCHS, SPE, R = 3, 6, 2


@pytest.mark.timeout(120)
def test_fit_killed_mid_epoch_in_sync_mode_resumes_at_the_exact_closure(tmp_path):
    backup, gate = tmp_path / "backup", tmp_path / "gate"
    args = [sys.executable, str(PROGRAM), str(backup), "sync", str(gate), str(GATE_STEP)]
    env = {**os.environ, "PYTHONPATH": str(PROGRAM.parents[2])}
    quiescent = GATE_STEP  # steps 0-4 of R = 2 closures: 10 closures, epoch 2's step 4
    held = quiescent * R
    program = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                               start_new_session=True)
    daemons: list[int] = []
    first = []
    try:
        for line in program.stdout:
            first.append(line)
            if line.startswith("daemons:"):
                daemons = [int(p) for p in line.split()[1:]]
                break
        assert len(daemons) == 3, "".join(first)
        deadline = time.monotonic() + 60
        while quiescent not in [step for step, _ in complete_steps(backup / "ps")]:
            assert time.monotonic() < deadline and program.poll() is None, "".join(first) + program.stdout.read()
            time.sleep(0.05)
    finally:
        _stop(program, daemons)
        program.stdout.close()
    assert max(step for step, _ in complete_steps(backup / "ps")) == quiescent  # nothing moved past the gate

    gate.touch()
    out = subprocess.run(args, capture_output=True, text=True, timeout=90, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    resumed = re.search(r"restored global step (\d+) \((\d+) closures\): resuming at epoch (\d+), step (\d+)", text)
    assert resumed, text
    step, closures, epoch, in_epoch = (int(g) for g in resumed.groups())
    assert (step, closures, epoch, in_epoch) == (quiescent, held, 2, held - SPE), text
    final = json.loads(text.strip().splitlines()[-1])
    total = EPOCHS * SPE
    # every closure of the 3 epochs applied once: none lost with the driver, none run twice
    assert final == {"global_step": total // R, "w": total // R}, text  # divmod(step, SPE) would give 11 and 11
