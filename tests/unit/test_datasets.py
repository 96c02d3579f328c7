"""Per-worker datasets: every iter() is a fresh iterator (TF semantics), and a worker keeps a bounded number."""

from pscluster.client.datasets import MAX_ITERATORS, PerWorkerDataset, WorkerDatasets, WorkerInfo


def draw(worker, handle):
    return next(worker.iterator(handle.iterator_id, handle.fn_bytes, handle.skipped))


def test_each_iter_call_starts_a_fresh_iterator_as_tf_does():
    ds = PerWorkerDataset(lambda: range(1, 2))
    worker = WorkerDatasets(WorkerInfo("w0", 0))
    assert [draw(worker, iter(ds)) for _ in range(3)] == [1, 1, 1]


def test_one_handle_continues_its_own_iterator():
    ds = PerWorkerDataset(lambda info: range(10 * info.worker_index, 10 * info.worker_index + 5))
    worker = WorkerDatasets(WorkerInfo("w2", 2))
    it = iter(ds)
    assert [draw(worker, it) for _ in range(3)] == [20, 21, 22]


def test_a_worker_keeps_at_most_max_iterators_and_restarts_an_evicted_one():
    ds = PerWorkerDataset(lambda: iter(range(100)))
    worker = WorkerDatasets(WorkerInfo("w0", 0))
    first = iter(ds)
    assert [draw(worker, first), draw(worker, first)] == [0, 1]
    for _ in range(MAX_ITERATORS):
        draw(worker, iter(ds))
    assert len(worker._iterators) == MAX_ITERATORS
    assert draw(worker, first) == 0  # evicted: starts over


def test_a_skipped_dataset_starts_each_workers_iterator_past_its_first_elements_and_refuses_a_bad_count():
    import pickle

    import pytest

    from pscluster.errors import InvalidArgumentError

    ds = PerWorkerDataset(lambda info: iter(range(10 * info.worker_index, 10 * info.worker_index + 9)))
    skipped = ds.skip(2).skip(1)  # counts add up, as tf.data's skips do
    w0, w1 = WorkerDatasets(WorkerInfo("w0", 0)), WorkerDatasets(WorkerInfo("w1", 1))
    handle = pickle.loads(pickle.dumps(iter(skipped)))  # as a closure's argument travels to a worker
    assert [draw(w0, handle), draw(w0, handle), draw(w1, handle)] == [3, 4, 13]
    assert draw(w0, iter(ds)) == 0  # the dataset skipped from is unchanged
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(InvalidArgumentError, match="skip: count"):
            ds.skip(bad)
