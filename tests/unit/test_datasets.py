"""Per-worker datasets: every iter() is a fresh iterator (TF semantics), and a worker keeps a bounded number."""

from pscluster.client.datasets import MAX_ITERATORS, PerWorkerDataset, WorkerDatasets, WorkerInfo


def draw(worker, handle):
    return next(worker.iterator(handle.iterator_id, handle.fn_bytes))


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
