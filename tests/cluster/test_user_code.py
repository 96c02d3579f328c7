"""User code reaches workers: helper modules of the user's project, any working directory, TF's iter()."""

import sys

import pytest

import pscluster as ps

pytestmark = pytest.mark.cluster

HELPER = '''
SCALE = 3


def triple(x):
    return SCALE * x


class Box:
    def __init__(self, value):
        self.value = value
'''


def test_closures_call_a_helper_module_that_workers_cannot_import(tmp_path, monkeypatch, fresh_cluster):
    project = tmp_path / "project"
    project.mkdir()
    (project / "helper_7f3a.py").write_text(HELPER)
    monkeypatch.syspath_prepend(str(project))  # the driver imports it; workers' sys.path never has it
    monkeypatch.delitem(sys.modules, "helper_7f3a", raising=False)
    import helper_7f3a as helper

    cluster = fresh_cluster(1, 2, supervise=False)
    with ps.ClusterCoordinator(cluster.settings()) as coord:
        coord.wait_for_workers(2)
        tripled = [coord.schedule(helper.triple, args=(i,)) for i in range(6)]
        boxed = coord.schedule(lambda: helper.Box(helper.triple(5)))
        coord.join(timeout=60)
        assert coord.fetch(tripled) == [0, 3, 6, 9, 12, 15]
        box = boxed.fetch()
        assert isinstance(box, helper.Box) and box.value == 15  # the driver's own class comes back
    monkeypatch.delitem(sys.modules, "helper_7f3a")


def test_local_cluster_starts_from_a_directory_holding_a_pscluster_folder(tmp_path, monkeypatch, fresh_cluster):
    checkout = tmp_path / "checkout"
    (checkout / "pscluster").mkdir(parents=True)
    (checkout / "pscluster" / "__init__.py").write_text("")  # a checkout's folder, shadowing the install
    (checkout / "pscluster" / "cli.py").write_text("raise SystemExit('pscluster.ops.cli shadowed by the cwd')\n")
    monkeypatch.chdir(checkout)
    cluster = fresh_cluster(1, 1, supervise=False, workdir=tmp_path / "cluster")
    with ps.ClusterCoordinator(cluster.settings()) as coord:
        coord.wait_for_workers(1)
        assert coord.schedule(lambda: 6 * 7).fetch(timeout=60) == 42


def test_every_iter_of_a_per_worker_dataset_is_a_fresh_iterator(fresh_cluster):
    cluster = fresh_cluster(1, 1, supervise=False)
    with ps.ClusterCoordinator(cluster.settings()) as coord:
        coord.wait_for_workers(1)
        ds = coord.create_per_worker_dataset(lambda: range(1, 2))

        def take(iterator):
            return next(iterator)

        values = [coord.schedule(take, args=(iter(ds),)) for _ in range(3)]
        coord.join(timeout=60)
        assert coord.fetch(values) == [1, 1, 1]  # TF: each iter() starts the dataset again
        it = iter(ds)
        first = coord.schedule(take, args=(it,))
        coord.join(timeout=60)
        again = coord.schedule(take, args=(it,))
        with pytest.raises(StopIteration):
            coord.join(timeout=60)
        assert first.fetch() == 1 and again.done()
