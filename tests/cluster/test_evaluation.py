"""Training curves and the side-car evaluator on real daemons, read back from TensorBoard event files."""

import subprocess
import sys
import time

import numpy as np
import pytest

import pscluster as ps
from tests.cluster.procs import Procs, make_coord, read_until  # noqa: F401 - make_coord: a fixture
from tests.events import scalars

pytestmark = pytest.mark.cluster


def descend(w, target):
    """One SGD step on |w - target|^2 / 2; reports the loss before the step."""
    value = w.pull()
    w.push(value - target)
    ps.report(loss=float(0.5 * np.sum((value - target) ** 2)))
    time.sleep(0.005)


def test_the_coordinator_writes_a_falling_loss_curve_and_closures_per_s(fresh_cluster, tmp_path):
    cluster = fresh_cluster(1, 2, supervise=False)
    coord = ps.ClusterCoordinator(cluster.settings(logdir=str(tmp_path / "logs"), curve_interval_s=0.2))
    try:
        coord.wait_for_workers(2)
        w = coord.create_variable("w", initial_value=np.full(4, 5.0, np.float32), optimizer=ps.SGD(0.05))
        for _ in range(300):
            coord.schedule(descend, args=(w, np.ones(4, np.float32)))
        coord.join(timeout=90)
    finally:
        coord.shutdown()  # writes the last interval and closes the event file
    got = scalars(tmp_path / "logs" / "train")
    loss = got["train/loss"]
    assert len(loss) >= 2 and loss[-1][0] == 300  # x axis: closures completed
    assert loss[0][1] > 4 * loss[-1][1] and loss[-1][1] < 1.0
    assert all(rate > 0 for _, rate in got["train/closures_per_s"])


@pytest.mark.parametrize("make_coord", ["remote"], indirect=True)
def test_a_remote_drivers_hyperparameter_changes_show_in_the_daemons_curves(fresh_cluster, make_coord, tmp_path):
    from pscluster.proto import pscluster_pb2 as pb

    from pscluster.errors import InvalidArgumentError

    cluster = fresh_cluster(1, 0, supervise=False)
    coord = make_coord(cluster, logdir=str(tmp_path / "logs"), curve_interval_s=0.2)
    try:
        coord.create_variable("w", initial_value=np.zeros(3, np.float32), optimizer=ps.Momentum(0.1, 0.9))
        coord.set_learning_rate(0.02)
        coord.set_hyperparameters(["w"], momentum=0.5)
        with pytest.raises(InvalidArgumentError, match="needs named finite values"):  # a bad note changes nothing
            coord._call("NoteHyperparameters", pb.HyperparametersNote(values={"momentum": float("nan")},
                                                                      all_variables=True))
        want = {"hparams/learning_rate": 0.02, "hparams/momentum_w_": 0.5}  # tensorboardX's spelling of momentum[w]
        deadline = time.monotonic() + 15
        while not want.keys() <= (got := scalars(tmp_path / "logs" / "train")).keys():
            assert time.monotonic() < deadline, f"no hparams curves after 15 s: {sorted(got)}"
            time.sleep(0.1)
    finally:
        coord.shutdown()
    for tag, value in want.items():
        assert got[tag][-1][1] == pytest.approx(value), tag
    assert [tag for tag in got if tag.startswith("hparams/")] == list(want)


EVAL_MODULE = '''
import numpy as np

def evaluate(variables):
    return {"w_mean": float(np.mean(variables["w"])), "n": len(variables)}

def broken(variables):
    return 3
'''


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.close()


def test_the_evaluator_daemon_evaluates_each_new_checkpoint(fresh_cluster, tmp_path, procs):
    (tmp_path / "my_eval.py").write_text(EVAL_MODULE)
    cluster = fresh_cluster(2, 0, supervise=False, checkpoint_dir=tmp_path / "ckpt")
    with ps.PSClient(cluster.settings()) as client:
        w = client.create_variable("w", initial_value=np.arange(8.0, dtype=np.float32).reshape(4, 2),
                                   partitioner=ps.FixedShardsPartitioner(2), optimizer=ps.SGD(1.0))
        client.checkpoint(5)
        ev = procs.start("evaluator", "--cluster", str(cluster.cluster_file), "--eval-fn", "my_eval:evaluate",
                         "--checkpoint-dir", str(tmp_path / "ckpt"), "--logdir", str(tmp_path / "logs"),
                         "--every-s", "0.2", cwd=str(tmp_path))
        read_until(ev, "READY evaluator (checkpoints")
        assert "eval step 5 (checkpoints, 1 variables): n=1, w_mean=3.5" in read_until(ev, "eval step 5")[-1]
        client.push([(w, np.ones((4, 2), np.float32))])
        client.checkpoint(9)
        assert "w_mean=2.5" in read_until(ev, "eval step 9")[-1]
    ev.terminate()
    out, _ = ev.communicate(timeout=30)
    assert ev.returncode == 0 and "Traceback" not in out, out
    assert scalars(tmp_path / "logs" / "eval")["eval/w_mean"] == [(5, 3.5), (9, 2.5)]


def test_the_evaluator_pulls_live_variables_and_a_bad_eval_fn_is_one_line(fresh_cluster, tmp_path, procs):
    (tmp_path / "my_eval.py").write_text(EVAL_MODULE)
    cluster = fresh_cluster(1, 0, supervise=False)
    with ps.PSClient(cluster.settings()) as client:
        client.create_variable("w", initial_value=np.full(3, 2.0, np.float32))
        ev = procs.start("evaluator", "--cluster", str(cluster.cluster_file), "--eval-fn", "my_eval:evaluate",
                         "--from", "variables", "--every-s", "0.2", cwd=str(tmp_path))
        assert "variables, 1 variables): n=1, w_mean=2" in read_until(ev, "eval step")[-1]
        ev.terminate()
        ev.communicate(timeout=30)
    for spec, says in (("my_eval:missing", "my_eval has no function 'missing'"),
                       ("nope_module:f", "cannot import nope_module"), ("no-colon", "expected module:function")):
        bad = subprocess.run([sys.executable, "-m", "pscluster.ops.cli", "evaluator", "--cluster", str(cluster.cluster_file),
                              "--eval-fn", spec], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert bad.returncode == 2 and says in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
