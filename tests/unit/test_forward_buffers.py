"""The forwards' reused gradient copies (server/forward_buffers.py): a buffer is handed out again only once nothing
holds it, and the pool stays bounded."""

from __future__ import annotations

import numpy as np
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server import replica_wire
from pscluster.server.forward_buffers import MIN_BYTES, PAGE, ForwardBuffers, ForwardTemplates

from pscluster import codec


def _grad(value: float) -> np.ndarray:
    return np.full((256, 128), value, np.float32)  # 128 KiB: above MIN_BYTES


def test_a_dropped_copy_is_reused_and_a_held_one_never() -> None:
    pool = ForwardBuffers()
    first = pool.copy(_grad(1.0))
    one_buffer = pool.kept_bytes
    del first
    again = pool.copy(_grad(2.0))
    assert pool.kept_bytes == one_buffer and np.all(again == 2.0)  # the first buffer, again
    other = pool.copy(_grad(3.0))  # `again` is still held: a buffer of its own
    assert pool.kept_bytes == 2 * one_buffer and not np.shares_memory(other, again)
    assert np.all(again == 2.0) and np.all(other == 3.0)


def test_a_view_of_a_copy_keeps_it_in_use() -> None:
    pool = ForwardBuffers()
    copy = pool.copy(_grad(1.0))
    view = copy.reshape(-1).view(np.uint8)  # as a send's byte views of the batch
    del copy
    fresh = pool.copy(_grad(5.0))
    assert not np.shares_memory(fresh, view)
    assert np.all(view.view(np.float32) == 1.0)  # the held bytes were not overwritten


def test_the_pool_is_bounded_per_shape_and_in_bytes() -> None:
    pool = ForwardBuffers(per_shape=2, max_bytes=1 << 30)
    held = [pool.copy(_grad(float(i))) for i in range(5)]  # all held: 2 kept, 3 plain copies
    assert pool.kept_bytes == 2 * (held[0].nbytes + PAGE)
    assert [float(h[0, 0]) for h in held] == [0.0, 1.0, 2.0, 3.0, 4.0]
    small = ForwardBuffers(max_bytes=_grad(0).nbytes + PAGE)
    a, b = small.copy(_grad(1.0)), small.copy(_grad(2.0))
    assert small.kept_bytes == a.nbytes + PAGE and np.all(b == 2.0)


def test_small_and_strided_arrays_are_copied_exactly() -> None:
    pool = ForwardBuffers()
    tiny = np.arange(10, dtype=np.float32)
    assert tiny.nbytes < MIN_BYTES and np.array_equal(pool.copy(tiny), tiny)
    strided = np.arange(512 * 256, dtype=np.float32).reshape(512, 256)[:, ::2]
    out = pool.copy(strided)
    assert out.flags.c_contiguous and np.array_equal(out, strided)


def test_a_copy_lands_at_its_sources_offset_in_the_page() -> None:
    pool = ForwardBuffers()
    raw = np.zeros(_grad(0).nbytes + 2 * PAGE, np.uint8)
    for shift in (0, 16, 20, 4000):  # sources at several offsets (as views in a connection's buffer)
        src = raw[shift:shift + _grad(0).nbytes].view(np.float32).reshape(256, 128)
        src[...] = shift
        out = pool.copy(src)
        assert out.ctypes.data % PAGE == src.ctypes.data % PAGE
        assert out.shape == src.shape and out.dtype == src.dtype and np.all(out == shift)
        del out


def test_a_template_forward_is_a_fresh_message_each_time() -> None:
    templates = ForwardTemplates()
    grad = _grad(0.0)
    first, _ = templates.forward("w", 1, grad)
    first.version = 7
    first.push_id = "p"
    second, const = templates.forward("w", 1, grad)
    assert second.version == 0 and not second.push_id  # the first one's fields did not leak into the template
    expected = pb.ReplicaForward(ref=pb.ShardRef(variable="w", shard_index=1), grad=codec.header(grad.dtype, grad.shape))
    assert second == expected
    assert const == replica_wire.const_part("w", 1, grad.dtype, grad.shape)  # the compact form's, kept with it
    other, _ = templates.forward("w", 1, grad[:10])
    assert list(other.grad.shape) == [10, 128]
