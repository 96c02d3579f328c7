"""Safetensors files written and read as whole arrays, with no intermediate copy.

Why not safetensors.numpy: its save_file turns every array into a bytes object (a full copy) before
the write, and get_tensor returns a read-only view of another bytes copy, which a PS then copies again
to update in place. Here an array goes from its own memory to the file in one write, and comes back
from the file straight into a fresh writable array (readinto). The file is the standard format
(8-byte little-endian header length, a JSON header padded to 8 bytes, the data in header order), so
safetensors' own readers open it too.

    write(path, {"a": np.arange(3)}, {"step": "7"})
    with TensorFile(path) as f:
        f.metadata()["step"], f.get("a")
"""

from __future__ import annotations

import json
import mmap
import os
import pathlib
import struct
from types import TracebackType
from typing import Any

import numpy as np

from pscluster.errors import InvalidArgumentError

_CODES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "U64": np.uint64,
          "I32": np.int32, "U32": np.uint32, "I16": np.int16, "U16": np.uint16, "I8": np.int8, "U8": np.uint8,
          "BOOL": np.bool_, "C64": np.complex64}
_DTYPES = {np.dtype(t): code for code, t in _CODES.items()}
_CHUNK = 1 << 28  # bytes per write/read call: bounds the kernel's per-call work, not the memory


def write(path: str | os.PathLike[str], tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """Write `tensors` (numpy dtypes safetensors knows) and string `metadata` to a new file at path.

    Raises:
        InvalidArgumentError: a dtype the format has no code for.
    """
    header: dict[str, object] = {"__metadata__": metadata}
    plain: dict[str, np.ndarray] = {}
    entries: dict[str, dict[str, object]] = {}
    for name, arr in tensors.items():
        code = _DTYPES.get(arr.dtype.newbyteorder("="))
        if code is None:
            raise InvalidArgumentError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors code")
        want = arr.dtype.newbyteorder("<")
        if arr.dtype != want or not arr.flags.c_contiguous:  # (np.ascontiguousarray makes a 0-d array 1-d)
            arr = np.array(arr, dtype=want, order="C")
        entries[name] = {"dtype": code, "shape": list(arr.shape)}  # the header keeps the caller's order
        plain[name] = arr
    arrays = []
    offset = 0
    # the data by falling item size (stable): each array starts at a multiple of its item size (the data
    # section starts at a multiple of 8), so `view` maps it aligned
    for name in sorted(plain, key=lambda k: -plain[k].dtype.itemsize):
        arr = plain[name]
        entries[name]["data_offsets"] = [offset, offset + arr.nbytes]
        offset += arr.nbytes
        arrays.append(arr)
    header.update(entries)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for arr in arrays:
            flat = arr.reshape(-1).view(np.uint8)
            for start in range(0, flat.size, _CHUNK):
                f.write(flat[start:start + _CHUNK].data)


class TensorFile:
    """A safetensors file opened for reading arrays by name."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = pathlib.Path(path)
        self._f = open(self.path, "rb")
        self._map: mmap.mmap | None = None
        try:
            self._meta, self._entries, self._base = _header(self._f, self.path)
        except InvalidArgumentError:
            self._f.close()
            raise

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the file (arrays from `view` stay valid: each holds the mapping)."""
        self._f.close()
        self._map = None

    def metadata(self) -> dict[str, str]:
        """The header's string metadata."""
        return self._meta

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self._entries)

    def _entry(self, name: str) -> tuple[tuple[int, ...], np.dtype, int, int]:
        entry = self._entries.get(name)
        if entry is None:
            raise InvalidArgumentError(f"{self.path}: no tensor {name!r} (it holds {sorted(self._entries)})")
        shape, (begin, end) = entry["shape"], entry["data_offsets"]
        dtype = np.dtype(_CODES[entry["dtype"]]).newbyteorder("<")
        if int(np.prod(shape, dtype=np.int64)) * dtype.itemsize != end - begin:
            raise InvalidArgumentError(f"{self.path}: tensor {name!r} holds {end - begin} bytes for shape {list(shape)}")
        return shape, dtype, begin, end

    def view(self, name: str) -> np.ndarray:
        """The named tensor as a writable, C-contiguous array mapped from the file copy-on-write: no read
        and no copy (pages come from the page cache as they are first read; a write stays in this
        process). Falls back to `get` where the data is not aligned (files written by other writers).

        Why: a restore read each file into fresh arrays (one copy and a first write of every page), then
        gathered rows from them into its tables (a second copy): at 10 M keys x 8 floats the read was
        a third of the restore's CPU. Checkpoint files are replaced by rename, never rewritten in place,
        so a mapping sees one file's bytes for its whole life.
        """
        shape, dtype, begin, end = self._entry(name)
        at = self._base + begin
        if at % dtype.itemsize or end == begin:
            return self.get(name)
        if self._map is None:
            self._map = mmap.mmap(self._f.fileno(), 0, flags=mmap.MAP_PRIVATE,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        return np.frombuffer(self._map, dtype, count=(end - begin) // dtype.itemsize, offset=at).reshape(shape)

    def get(self, name: str) -> np.ndarray:
        """The named tensor as a new writable, C-contiguous array read straight from the file."""
        shape, dtype, begin, end = self._entry(name)
        arr = np.empty(shape, dtype)
        flat = arr.reshape(-1).view(np.uint8)
        self._f.seek(self._base + begin)
        done = 0
        while done < flat.size:
            got = self._f.readinto(flat[done:done + _CHUNK].data)
            if not got:
                raise InvalidArgumentError(f"{self.path}: tensor {name!r} is cut short at byte {done}")
            done += got
        return arr


def _header(f: Any, path: pathlib.Path) -> tuple[dict[str, str], dict[str, dict[str, Any]], int]:
    """(metadata, entries by name, offset of the data) of an open file, every entry checked against the
    file's size: a bad header is refused here, by name, not later as a KeyError or a short read.

    Raises:
        InvalidArgumentError: the file is not a well-formed safetensors file.
    """
    file_size = os.fstat(f.fileno()).st_size
    head = f.read(8)
    if len(head) < 8:
        raise InvalidArgumentError(f"{path}: not a safetensors file ({file_size} bytes, no header length)")
    (size,) = struct.unpack("<Q", head)
    if size > file_size - 8:
        raise InvalidArgumentError(f"{path}: not a safetensors file (a header of {size} bytes in a file of "
                                   f"{file_size})")
    try:
        header = json.loads(f.read(size))
    except ValueError as e:
        raise InvalidArgumentError(f"{path}: not a safetensors file ({e})") from e
    if not isinstance(header, dict):
        raise InvalidArgumentError(f"{path}: not a safetensors file (the header is not a JSON object)")
    meta = header.pop("__metadata__", None) or {}
    data = file_size - 8 - size
    entries: dict[str, dict[str, Any]] = {}
    for name, entry in header.items():
        try:
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
            code = str(entry["dtype"])
        except (TypeError, ValueError, KeyError) as e:
            raise InvalidArgumentError(f"{path}: tensor {name!r} has a malformed header entry ({e!r})") from e
        if code not in _CODES:
            raise InvalidArgumentError(f"{path}: tensor {name!r} has dtype {code!r}, which pscluster does not read")
        if not 0 <= begin <= end or min(shape, default=0) < 0:
            raise InvalidArgumentError(f"{path}: tensor {name!r} has offsets {[begin, end]} and shape {list(shape)}")
        if end > data:
            raise InvalidArgumentError(f"{path}: tensor {name!r} ends at byte {end} of a data section of {data} "
                                       "(the file is cut short)")
        entries[name] = {"shape": shape, "data_offsets": (begin, end), "dtype": code}
    return meta, entries, 8 + size
