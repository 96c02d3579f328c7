"""Safetensors files written from and read into whole arrays (server/tensor_files.py)."""

import pathlib

import numpy as np
import pytest
from pscluster.server.tensor_files import TensorFile, write
from safetensors import safe_open

from pscluster.errors import InvalidArgumentError


def arrays() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"scalar": np.array(7, np.int64), "empty": np.zeros((0, 4), np.float32),
            "rows": rng.standard_normal((50, 3)).astype(np.float32), "flags": rng.random(9) > 0.5,
            "strided": np.arange(40, dtype=np.int32).reshape(8, 5)[:, ::2],
            "big_endian": np.arange(6, dtype=">f8"), "u8": np.arange(5, dtype=np.uint8)}


def test_round_trip_is_exact_writable_and_keeps_shapes_including_0d(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "a.safetensors"
    write(path, arrays(), {"step": "12"})
    with TensorFile(path) as f:
        assert f.metadata() == {"step": "12"} and f.keys() == list(arrays())
        for name, want in arrays().items():
            got = f.get(name)
            assert got.shape == want.shape and got.flags.writeable and got.flags.c_contiguous
            np.testing.assert_array_equal(got, want)
            assert got.dtype == want.dtype.newbyteorder("<")


def test_files_are_the_standard_format_safetensors_itself_reads(tmp_path: pathlib.Path) -> None:
    """Checkpoints stay readable by any safetensors reader (pscluster.checkpoint_files uses one)."""
    path = tmp_path / "a.safetensors"
    write(path, arrays(), {"k": "v"})
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
        for name, want in arrays().items():
            np.testing.assert_array_equal(f.get_tensor(name), want)


def test_unknown_dtype_and_truncated_files_are_refused_precisely(tmp_path: pathlib.Path) -> None:
    with pytest.raises(InvalidArgumentError, match="has no safetensors code"):
        write(tmp_path / "b", {"s": np.array(["x"])}, {})
    path = tmp_path / "a.safetensors"
    write(path, {"rows": np.ones((100, 8), np.float32)}, {})
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])
    with pytest.raises(InvalidArgumentError, match="ends at byte 3200 of a data section of 3190.*cut short"):
        TensorFile(path)  # refused on opening: the header's offsets are checked against the file's size
    (tmp_path / "junk").write_bytes(b"\x01")
    with pytest.raises(InvalidArgumentError, match="not a safetensors file"):
        TensorFile(tmp_path / "junk")


def test_a_header_longer_than_the_file_or_malformed_is_refused_by_name(tmp_path: pathlib.Path) -> None:
    """Not a MemoryError from reading a huge claimed header, nor a KeyError or TypeError later."""
    path = tmp_path / "a.safetensors"
    write(path, {"rows": np.ones((4, 2), np.float32)}, {})
    whole = path.read_bytes()
    size = int.from_bytes(whole[:8], "little")
    (tmp_path / "long").write_bytes((1 << 60).to_bytes(8, "little") + whole[8:])
    with pytest.raises(InvalidArgumentError, match=r"a header of 1152921504606846976 bytes in a file of \d+"):
        TensorFile(tmp_path / "long")
    (tmp_path / "short").write_bytes(b"\x00\x01")
    with pytest.raises(InvalidArgumentError, match="no header length"):
        TensorFile(tmp_path / "short")
    for bad, why in ((b'[1, 2]', "not a JSON object"), (b'{"x": {"shape": [2]}}', "malformed header entry"),
                     (b'{"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 0]}}', "dtype 'Q9'"),
                     (b'{"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}', r"offsets \[4, 0\]")):
        (tmp_path / "bad").write_bytes(len(bad).to_bytes(8, "little") + bad)
        with pytest.raises(InvalidArgumentError, match=why):
            TensorFile(tmp_path / "bad")
    with TensorFile(path) as f, pytest.raises(InvalidArgumentError, match=r"no tensor 'values' \(it holds \['rows'\]\)"):
        f.get("values")
    assert size < len(whole)


def test_mapped_views_equal_reads_are_aligned_writable_and_leave_the_file_alone(tmp_path: pathlib.Path) -> None:
    """A restore maps table files (view) instead of reading them: the arrays must be the same, aligned (numba
    kernels copy unaligned arrays), and a write to one must not reach the file or another reader."""
    path = tmp_path / "a.safetensors"
    odd = {"u8": np.arange(3, dtype=np.uint8), "f32": np.arange(5, dtype=np.float32),
           "i64": np.arange(7, dtype=np.int64), "f16": np.arange(3, dtype=np.float16), **arrays()}
    write(path, odd, {})
    with TensorFile(path) as f:
        assert f.keys() == list(odd)  # the header keeps the caller's order; the data goes by alignment
        views = {name: f.view(name) for name in odd}
    for name, want in odd.items():  # valid after close: each view holds the mapping
        got = views[name]
        np.testing.assert_array_equal(got, want)
        assert got.shape == want.shape and got.flags.aligned and got.flags.writeable and got.flags.c_contiguous
    views["rows"][:] = -1
    with TensorFile(path) as f:
        np.testing.assert_array_equal(f.get("rows"), odd["rows"])
        np.testing.assert_array_equal(f.view("rows"), odd["rows"])
        with pytest.raises(InvalidArgumentError, match="no tensor 'nope'"):
            f.view("nope")


def test_a_view_of_data_another_writer_left_unaligned_is_read_instead(tmp_path: pathlib.Path) -> None:
    """Files written before the data was laid out by item size (or by other writers) may hold a float32 array
    at an odd offset: view falls back to an aligned read, same values."""
    import json
    import struct
    small, rows = np.arange(3, dtype=np.uint8), np.arange(5, dtype=np.float32)
    header = json.dumps({"small": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
                         "rows": {"dtype": "F32", "shape": [5], "data_offsets": [3, 23]}}).encode()
    header += b" " * (-len(header) % 8)
    path = tmp_path / "old.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + small.tobytes() + rows.tobytes())
    with TensorFile(path) as f:
        got = f.view("rows")
        assert got.flags.aligned and got.flags.writeable
        np.testing.assert_array_equal(got, rows)
        np.testing.assert_array_equal(f.view("small"), small)
