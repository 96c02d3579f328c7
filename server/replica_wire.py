"""A compact wire form for the common replication batch: dense updates only (replicas: 2's async pushes).

A ReplicateRequest of dense updates costs the primary a message per forward, two copies into the request and
its serialisation, and the backup a parse plus ~15 field reads per forward and per tensor header, and a reply
message built and parsed (~0.1 ms per W2 batch in all, a third of a one-forward batch's CPU). Here a batch is
`<u32 count>` then per forward a fixed head (`<epoch, version, final_below: i64><const, push id lengths: u16>`),
the shard's constant part (built once per shard and dtype/shape: shard index, dimensions, dtype name,
variable) and the push id; the gradients' bytes follow as the frame's payload, in forward order. The backup
keeps what a constant part decodes to (bounded), so a forward costs it one struct unpack and a dict read. The
reply is `<u32 count>`, one outcome byte per forward, then an `<i64` version each. Every other forward (an
install, a config change, the sync state, a table's pull or sweep, sparse rows, a table's clock) travels as a
ReplicateRequest (server/replica_links.py); both forms mean the same to the backup (server/replica_backup.py).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from pscluster import codec
from pscluster.errors import InvalidArgumentError

COUNT = struct.Struct("<I")
HEAD = struct.Struct("<qqqHH")  # epoch, version, final_below, len(const), len(push_id)
CONST = struct.Struct("<iB")  # shard index, ndim; then ndim <q dims, <B len(dtype name), dtype name, variable
DIM = struct.Struct("<q")
MAX_PART = 0xFFFF  # a constant part or push id longer than a u16 length: the forward goes as a message
MAX_KEPT = 4096  # decoded constant parts a backup keeps; past it the cache starts over
OUTCOMES = (0, 1, 2)  # pb.ReplicaOutcome's values: APPLIED, GAP, STALE


class Dense(NamedTuple):
    """One decoded dense forward."""

    key: tuple[str, int]
    epoch: int
    version: int
    final_below: int
    push_id: str
    dtype: np.dtype
    shape: tuple[int, ...]
    nbytes: int


def const_part(variable: str, shard_index: int, dtype: np.dtype, shape: Sequence[int]) -> bytes:
    """A shard's constant part of a dense forward (the primary builds it once per shard, dtype and shape)."""
    name = codec.dtype_name(codec.wire_dtype(dtype)).encode()
    return CONST.pack(shard_index, len(shape)) + b"".join(DIM.pack(d) for d in shape) + \
        bytes([len(name)]) + name + variable.encode()


def forward(const: bytes, epoch: int, version: int, final_below: int, push_id: str) -> bytes | None:
    """One dense forward's bytes (its gradient's bytes go in the payload); None where a part is too long for
    the head's lengths (that forward goes as a message)."""
    pid = push_id.encode()
    if len(const) > MAX_PART or len(pid) > MAX_PART:
        return None
    return HEAD.pack(epoch, version, final_below, len(const), len(pid)) + const + pid


def request(forwards: Sequence[bytes]) -> bytes:
    """A batch's bytes: the count, then the forwards."""
    return COUNT.pack(len(forwards)) + b"".join(forwards)


def _decode_const(const: bytes) -> tuple[tuple[str, int], np.dtype, tuple[int, ...], int]:
    """(key, dtype, shape, nbytes) of a constant part, or InvalidArgumentError."""
    try:
        shard_index, ndim = CONST.unpack_from(const)
        at = CONST.size
        shape = tuple(DIM.unpack_from(const, at + DIM.size * i)[0] for i in range(ndim))
        at += DIM.size * ndim
        size = const[at]
        name = const[at + 1:at + 1 + size].decode()
        variable = const[at + 1 + size:].decode()
    except (struct.error, IndexError, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(f"replicate: a malformed dense forward ({exc})") from exc
    if at + 1 + size > len(const) or not variable:
        raise InvalidArgumentError("replicate: a dense forward without its dtype or variable")
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"replicate {variable}: negative dimension in {shape}")
    dtype = codec.wire_dtype(name)
    return (variable, shard_index), dtype, shape, math.prod(shape) * dtype.itemsize


def decode_request(data: bytes, payload_len: int,
                   kept: dict[bytes, tuple[tuple[str, int], np.dtype, tuple[int, ...], int]]) -> list[Dense]:
    """A batch's forwards, all checked before any is applied; kept: decoded constant parts (filled here).

    Raises:
        InvalidArgumentError: malformed bytes, a bad dtype or shape, or sizes that do not add up to payload_len.
    """
    try:
        (count,) = COUNT.unpack_from(data)
    except struct.error as exc:
        raise InvalidArgumentError("replicate: a dense batch without its count") from exc
    out: list[Dense] = []
    at = COUNT.size
    total = 0
    for _ in range(count):
        if at + HEAD.size > len(data):
            raise InvalidArgumentError(f"replicate: a dense batch of {count} forwards holds {len(out)}")
        epoch, version, final_below, nconst, npid = HEAD.unpack_from(data, at)
        at += HEAD.size
        if at + nconst + npid > len(data):
            raise InvalidArgumentError("replicate: a dense forward longer than its batch")
        const = data[at:at + nconst]
        known = kept.get(const)
        if known is None:
            known = _decode_const(const)
            if len(kept) >= MAX_KEPT:
                kept.clear()
            kept[const] = known
        try:
            push_id = data[at + nconst:at + nconst + npid].decode()
        except UnicodeDecodeError as exc:
            raise InvalidArgumentError(f"replicate: a push id that is not UTF-8 ({exc})") from exc
        at += nconst + npid
        key, dtype, shape, nbytes = known
        out.append(Dense(key, epoch, version, final_below, push_id, dtype, shape, nbytes))
        total += nbytes
    if at != len(data):
        raise InvalidArgumentError(f"replicate: {len(data) - at} bytes after a dense batch's {count} forwards")
    if total != payload_len:
        raise InvalidArgumentError(f"replicate: payload of {payload_len} bytes, shapes announce {total}")
    return out


def views(forwards: Sequence[Dense], buf: np.ndarray) -> list[np.ndarray]:
    """The forwards' gradients: views of buf (the payload, sizes checked by `decode_request`), in order."""
    out = []
    at = 0
    for f in forwards:
        out.append(buf[at:at + f.nbytes].view(f.dtype).reshape(f.shape))
        at += f.nbytes
    return out


def reply(outcomes: Sequence[int], versions: Sequence[int]) -> bytes:
    """A dense batch's reply: the count, an outcome byte each, a version each."""
    n = len(outcomes)
    return COUNT.pack(n) + bytes(outcomes) + struct.pack(f"<{n}q", *versions)


def decode_reply(data: bytes, count: int) -> tuple[list[int], list[int]]:
    """(outcomes, versions) of a dense batch of `count` forwards.

    Raises:
        InvalidArgumentError: another count, a bad size or an unknown outcome.
    """
    if len(data) != COUNT.size + 9 * count or COUNT.unpack_from(data)[0] != count:
        raise InvalidArgumentError(f"a dense replicate reply of {len(data)} bytes for {count} forwards")
    outcomes = list(data[COUNT.size:COUNT.size + count])
    if any(o not in OUTCOMES for o in outcomes):
        raise InvalidArgumentError(f"a dense replicate reply with an unknown outcome in {outcomes}")
    return outcomes, list(struct.unpack_from(f"<{count}q", data, COUNT.size + count))
