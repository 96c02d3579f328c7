"""Read TensorBoard event files back (TFRecord frames of tensorboardX's Event protos) for the tests."""

import pathlib
import struct

from tensorboardX.proto import event_pb2


def scalars(logdir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] from every event file under logdir, in file order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(pathlib.Path(logdir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            record = data[pos + 12:pos + 12 + length]
            pos += 12 + length + 4  # length, its crc, the record, its crc
            event = event_pb2.Event()
            event.ParseFromString(record)
            for value in event.summary.value:
                out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out
