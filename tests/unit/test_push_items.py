"""A framed push's payload split into per-item gradient views (server/bulk.push_items), without sockets."""

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb
from pscluster.server.bulk import push_items

from pscluster import codec
from pscluster.errors import InvalidArgumentError


def _item(name: str, dtype: str, shape: tuple[int, ...], ids: np.ndarray | None = None) -> pb.PushItem:
    item = pb.PushItem(ref=pb.ShardRef(variable=name, shard_index=1), grad=pb.Tensor(dtype=dtype, shape=shape))
    if ids is not None:
        item.ids.CopyFrom(codec.encode(ids))
    return item


def test_items_are_views_of_the_payload_in_order():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.array([7, 8], np.int64)
    buf = np.frombuffer(a.tobytes() + b.tobytes(), np.uint8).copy()
    items = push_items([_item("a", "<f4", (2, 3)), _item("b", "<i8", (2,), ids=np.array([0, 5]))], buf, buf.size)
    assert [i.key for i in items] == [("a", 1), ("b", 1)]
    np.testing.assert_array_equal(items[0].grad, a)
    np.testing.assert_array_equal(items[1].grad, b)
    assert items[0].ids is None and list(items[1].ids) == [0, 5]
    assert np.shares_memory(items[0].grad, buf)  # no copy of the payload


@pytest.mark.parametrize("shape,nbytes,message", [
    ((-2, -3), 24, "negative dimension"),  # the product is positive: the sign check must see each dimension
    ((4,), 8, "fewer bytes"),
    ((1,), 8, "shapes announce 4"),
])
def test_bad_shapes_are_invalid_argument(shape, nbytes, message):
    buf = np.zeros(nbytes, np.uint8)
    with pytest.raises(InvalidArgumentError, match=message):
        push_items([_item("w", "<f4", shape)], buf, nbytes)


def test_a_non_numeric_dtype_is_invalid_argument():
    with pytest.raises(InvalidArgumentError, match="not numeric"):
        push_items([_item("w", "|b1", (4,))], np.zeros(4, np.uint8), 4)
