"""A PS killed (SIGKILL) while writing a checkpoint: its restarted process removes the temporary, and
the directory holds at most `keep` complete checkpoints plus the one being written."""

import os
import signal
import threading
import time

import numpy as np
import pytest

import pscluster as ps
from pscluster.checkpoint_files import complete_steps
from pscluster.ops.launcher import LocalCluster

pytestmark = pytest.mark.cluster


def test_a_ps_killed_mid_checkpoint_leaves_no_temporary_once_restarted(tmp_path):
    ckpt = tmp_path / "ckpt"
    cluster = LocalCluster(1, 0, workdir=tmp_path / "c", supervise=False, checkpoint_dir=ckpt,
                           extra={"keep_checkpoints": 2})
    cluster.start()
    try:
        with ps.PSClient(cluster.settings(), retry_for=1.0) as client:
            client.create_variable("big", initial_value=np.ones((24 << 20) // 4, np.float32))
            client.checkpoint(1)
            failed = []

            def save():
                try:
                    client.checkpoint(2)
                except ps.PsclusterError as exc:  # the PS dies under it
                    failed.append(exc)

            saver = threading.Thread(target=save, name="save")
            saver.start()
            deadline = time.monotonic() + 30
            while not list(ckpt.rglob("*.tmp-*")):  # the write has begun: kill the PS now
                assert time.monotonic() < deadline, "the save never started writing"
                time.sleep(0.001)
            os.kill(cluster.ps[0].pid, signal.SIGKILL)
            saver.join(timeout=30)
        assert failed and not saver.is_alive()
        assert list(ckpt.rglob("*.tmp-*")), "the killed save left its temporary (what this test is about)"
        cluster.ps[0].proc.wait(timeout=10)
        cluster.restart(cluster.ps[0])  # restores step 1, and removes the temporary at start
        assert not list(ckpt.rglob("*.tmp-*"))
        with ps.PSClient(cluster.settings()) as client:
            for step in (3, 4, 5):
                client.checkpoint(step)
        assert [s for s, _ in complete_steps(ckpt)] == [4, 5]
        assert sorted(p.name for p in ckpt.iterdir()) == ["step-000000000004", "step-000000000005"]
    finally:
        cluster.stop()
