"""The compact form of a batch of dense updates (server/replica_wire.py): what the primary encodes the backup
decodes, and bad bytes are refused precisely before anything is applied."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from pscluster.server import replica_wire as wire

from pscluster.errors import InvalidArgumentError


def _batch() -> tuple[bytes, int]:
    w = wire.const_part("w", 3, np.dtype(np.float32), (4, 2))
    b = wire.const_part("bias", 0, np.dtype("<f8"), (5,))
    forwards = [wire.forward(w, 7, 11, 2, "closure-1:3"), wire.forward(b, 1, 4, 0, ""),
                wire.forward(w, 7, 12, 2, "é")]
    return wire.request([f for f in forwards if f is not None]), 32 + 40 + 32


def test_a_batch_decodes_to_what_was_encoded_and_its_gradients_view_the_payload() -> None:
    data, size = _batch()
    kept: dict = {}
    forwards = wire.decode_request(data, size, kept)
    assert [(f.key, f.epoch, f.version, f.final_below, f.push_id, f.shape) for f in forwards] == [
        (("w", 3), 7, 11, 2, "closure-1:3", (4, 2)), (("bias", 0), 1, 4, 0, "", (5,)),
        (("w", 3), 7, 12, 2, "é", (4, 2))]
    assert len(kept) == 2  # one decoded constant part per shard, reused
    buf = np.arange(size, dtype=np.uint8)
    grads = wire.views(forwards, buf)
    assert [g.dtype for g in grads] == [np.dtype("<f4"), np.dtype("<f8"), np.dtype("<f4")]
    assert grads[1].tobytes() == buf[32:72].tobytes() and np.shares_memory(grads[2], buf)


def test_a_reply_round_trips_and_a_wrong_one_is_refused() -> None:
    data = wire.reply([0, 1, 2], [5, -1, 9])
    assert wire.decode_reply(data, 3) == ([0, 1, 2], [5, -1, 9])
    with pytest.raises(InvalidArgumentError, match="for 2 forwards"):
        wire.decode_reply(data, 2)
    with pytest.raises(InvalidArgumentError, match="unknown outcome"):
        wire.decode_reply(wire.reply([0, 7], [1, 2]), 2)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d[:2], "without its count"),
    (lambda d: struct.pack("<I", 4) + d[4:], "of 4 forwards holds 3"),
    (lambda d: d[:-1], "longer than its batch"),
    (lambda d: d + b"x", "1 bytes after"),
])
def test_a_malformed_batch_is_refused(mutate, message) -> None:
    data, size = _batch()
    with pytest.raises(InvalidArgumentError, match=message):
        wire.decode_request(mutate(data), size, {})


def test_sizes_that_do_not_add_up_and_bad_constant_parts_are_refused() -> None:
    data, size = _batch()
    with pytest.raises(InvalidArgumentError, match="payload of 8 bytes, shapes announce 104"):
        wire.decode_request(data, 8, {})
    for const, message in [(wire.const_part("w", 0, np.dtype(np.float32), (-1, 2)), "negative dimension"),
                           (struct.pack("<iB", 0, 0) + bytes([2]) + b"<U" + b"w", "not numeric"),
                           (struct.pack("<iB", 0, 3), "malformed dense forward"),
                           (struct.pack("<iB", 0, 0) + bytes([3]) + b"<f4", "without its dtype or variable")]:
        with pytest.raises(InvalidArgumentError, match=message):
            wire.decode_request(wire.request([wire.forward(const, 1, 1, 0, "") or b""]), 0, {})


def test_a_part_too_long_for_the_head_leaves_the_forward_to_the_message_form() -> None:
    const = wire.const_part("w", 0, np.dtype(np.float32), (2,))
    assert wire.forward(const, 1, 1, 0, "p" * wire.MAX_PART) is not None
    assert wire.forward(const, 1, 1, 0, "p" * (wire.MAX_PART + 1)) is None
    assert wire.forward(wire.const_part("v" * wire.MAX_PART, 0, np.dtype(np.float32), (2,)), 1, 1, 0, "") is None
