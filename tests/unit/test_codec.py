"""Tensor codec: raw little-endian bytes with dtype and shape; malformed tensors are rejected."""

import numpy as np
import pytest
from pscluster.proto import pscluster_pb2 as pb

from pscluster import codec
from pscluster.errors import InvalidArgumentError


@pytest.mark.parametrize("arr", [np.arange(6, dtype=np.float32).reshape(2, 3), np.array(3.5), np.zeros((0, 4), "i8"),
                                 np.arange(4, dtype=">f8"), np.arange(5, dtype=np.uint8)])
def test_round_trip_keeps_values_shape_and_dtype(arr):
    out = codec.decode(codec.encode(arr))
    assert out.shape == arr.shape and out.dtype == arr.dtype.newbyteorder("<")
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("msg,match", [
    (pb.Tensor(dtype="<f4", shape=[2], data=b"\0" * 7), "do not hold"),
    (pb.Tensor(dtype="<f4", shape=[-1], data=b""), "negative"),
    (pb.Tensor(dtype="", shape=[1], data=b"\0"), "missing dtype"),
    (pb.Tensor(dtype="|O", shape=[1], data=b"\0" * 8), "not numeric"),
    (pb.Tensor(dtype="zz", shape=[1], data=b"\0"), "unknown dtype|not numeric"),
])
def test_malformed_tensor_is_rejected(msg, match):
    with pytest.raises(InvalidArgumentError, match=match):
        codec.decode(msg)


def test_ids_must_be_1d_int64():
    with pytest.raises(InvalidArgumentError, match="1-D int64"):
        codec.decode_ids(codec.encode(np.zeros((2, 2), np.int64)))
    with pytest.raises(InvalidArgumentError, match="1-D int64"):
        codec.decode_ids(codec.encode(np.zeros(2, np.int32)))


def test_a_shape_no_array_can_have_is_invalid_argument_even_with_a_zero_dimension():
    msg = pb.Tensor(dtype="<f4", shape=[0, 2**61], data=b"")
    with pytest.raises(InvalidArgumentError, match="larger than any array"):
        codec.decode(msg)
