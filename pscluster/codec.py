"""Tensors on the wire: raw little-endian bytes with dtype and shape, never pickled."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

from pscluster.errors import InvalidArgumentError
from pscluster.proto import pscluster_pb2 as pb

# Numeric dtypes a variable may have; bool/object/str never reach a PS.
ALLOWED_KINDS = frozenset("iuf")
BFLOAT16 = "bfloat16"  # ml_dtypes' bfloat16 (numpy kind "V"): a gradient dtype, named so on the wire


def _bfloat16() -> np.dtype:
    import ml_dtypes  # imported on first sight of a bfloat16 array: daemons start without it

    dt: np.dtype = np.dtype(ml_dtypes.bfloat16)
    return dt


def dtype_name(dtype: np.dtype) -> str:
    """A wire dtype's name in tensor headers: numpy's `<f4` form, or "bfloat16"."""
    return BFLOAT16 if dtype.kind == "V" and dtype.name == BFLOAT16 else dtype.str


def half_of(master: np.dtype, dtype: np.dtype) -> bool:
    """True when dtype is a 16-bit float gradient the PS upcasts into a float32 master (mixed precision)."""
    return master == np.float32 and (dtype == np.float16 or dtype_name(dtype) == BFLOAT16)


def wire_dtype(dtype: np.dtype | str | type) -> np.dtype:
    """The little-endian numeric dtype for `dtype`, or InvalidArgumentError."""
    if isinstance(dtype, str):
        return _wire_dtype_of_name(dtype)  # every tensor header names one: a lookup, not a parse
    if isinstance(dtype, np.dtype):
        return _wire_dtype_of_dtype(dtype)  # every forward and push: a lookup too
    return _wire_dtype(dtype)


@functools.lru_cache(maxsize=64)
def _wire_dtype_of_name(name: str) -> np.dtype:
    return _wire_dtype(name)


@functools.lru_cache(maxsize=64)
def _wire_dtype_of_dtype(dtype: np.dtype) -> np.dtype:
    return _wire_dtype(dtype)


def _wire_dtype(dtype: np.dtype | str | type) -> np.dtype:
    # a string test first: comparing a numpy dtype with "bfloat16" makes numpy parse the string and fail
    # (~20 us, a third of a replicated update's bookkeeping)
    if isinstance(dtype, str) and dtype == BFLOAT16:
        return _bfloat16()
    try:
        dt = np.dtype(dtype)
    except TypeError as exc:
        raise InvalidArgumentError(f"unknown dtype {dtype!r}") from exc
    if dt.kind == "V" and dt.name == BFLOAT16:
        return dt
    if dt.kind not in ALLOWED_KINDS:
        raise InvalidArgumentError(f"dtype {dt} is not numeric; use an integer or floating dtype")
    return dt.newbyteorder("<")


def encode(array: np.ndarray) -> pb.Tensor:
    """Encode a numpy array as a Tensor message (one copy, into the protobuf bytes field)."""
    dt = wire_dtype(array.dtype)
    arr = np.asarray(array).astype(dt, order="C", copy=False)  # (ascontiguousarray turns 0-d into 1-d)
    return pb.Tensor(dtype=dtype_name(dt), shape=arr.shape, data=arr.tobytes())


def header(dtype: np.dtype, shape: Sequence[int]) -> pb.Tensor:
    """A Tensor message with dtype and shape but no data (streaming headers)."""
    return pb.Tensor(dtype=dtype_name(wire_dtype(dtype)), shape=list(shape))


def decode(msg: pb.Tensor, what: str = "tensor") -> np.ndarray:
    """Decode a Tensor message into a read-only array viewing its bytes; validates sizes."""
    shape = tuple(int(s) for s in msg.shape)
    if any(s < 0 for s in shape):
        raise InvalidArgumentError(f"{what}: negative dimension in shape {shape}")
    dt = wire_dtype(msg.dtype) if msg.dtype else None
    if dt is None:
        raise InvalidArgumentError(f"{what}: missing dtype")
    expected = math.prod(shape) * dt.itemsize
    if len(msg.data) != expected:
        raise InvalidArgumentError(
            f"{what}: {len(msg.data)} bytes do not hold shape {shape} of {dt} ({expected} bytes)")
    if math.prod(s for s in shape if s) * dt.itemsize > np.iinfo(np.intp).max:
        # an empty shape whose other dimensions no array can have: numpy refuses it even with no elements
        raise InvalidArgumentError(f"{what}: shape {shape} of {dt} is larger than any array can be")
    return np.frombuffer(msg.data, dtype=dt).reshape(shape)


def decode_ids(msg: pb.Tensor, what: str = "ids") -> np.ndarray:
    """Decode row ids: a 1-D int64 tensor."""
    ids = decode(msg, what)
    if ids.dtype != np.dtype("<i8") or ids.ndim != 1:
        raise InvalidArgumentError(f"{what}: row ids must be a 1-D int64 tensor, got {ids.dtype} {ids.shape}")
    return ids
