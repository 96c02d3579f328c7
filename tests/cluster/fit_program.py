"""A training program for test_fit_resume.py: fit with BackupAndRestore on 1 PS + 2 workers in an update mode.

    python tests/cluster/fit_program.py BACKUP_DIR MODE GATE_FILE GATE_STEP

Each closure pulls the scalar `w`, then pushes the gradient -1 (SGD, lr 1): w counts the updates applied.
A closure whose token step (sync: the global step) is at least GATE_STEP waits for GATE_FILE to exist, so a first run is killed mid-epoch wherever the machine's speed puts it.
The program prints its daemons' pids, then, when it ends, one line of JSON with the final global step and w.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import numpy as np

import pscluster as ps
from pscluster.ops.launcher import LocalCluster
from pscluster.training import BackupAndRestore, fit

EPOCHS, STEPS_PER_EPOCH, R = 3, 6, 2


def main(backup: str, mode: str, gate: str, gate_step: int) -> None:
    """Run (or resume) the fit; print the final global step and w."""
    with LocalCluster(1, 2, workdir=pathlib.Path(backup, "cluster"), checkpoint_dir=pathlib.Path(backup, "ps"),
                      restore=True) as cluster:
        print("daemons:", " ".join(str(d.pid) for d in cluster.ps + cluster.workers), flush=True)
        coord = ps.ClusterCoordinator(cluster.settings(checkpoint_every_steps=1, checkpoint_every_s=None))
        try:
            coord.wait_for_workers(2)
            w = coord.create_variable("w", initial_value=np.zeros((), np.float32), optimizer=ps.SGD(1.0))
            coord.configure_sync(mode, replicas_to_aggregate=R, staleness=2)

            def step(iterator: object) -> float:
                value = float(w.pull())
                token = ps.sync_token()
                deadline = time.monotonic() + 60
                while token is not None and token.step >= gate_step and not os.path.exists(gate):
                    if time.monotonic() > deadline:
                        raise TimeoutError("the gate never opened")
                    time.sleep(0.01)
                w.push(np.array(-1.0, np.float32))
                return value

            fit(coord, step, coord.create_per_worker_dataset(lambda info: iter(())), epochs=EPOCHS,
                steps_per_epoch=STEPS_PER_EPOCH, learning_rate=1.0,
                callbacks=[BackupAndRestore(pathlib.Path(backup, "callbacks"))], verbose=2)
            print(json.dumps({"global_step": coord.global_step, "w": float(w.pull())}), flush=True)
        finally:
            coord.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
