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
    arrays = []
    offset = 0
    for name, arr in tensors.items():
        code = _DTYPES.get(arr.dtype.newbyteorder("="))
        if code is None:
            raise InvalidArgumentError(f"tensor {name!r}: dtype {arr.dtype} has no safetensors code")
        want = arr.dtype.newbyteorder("<")
        if arr.dtype != want or not arr.flags.c_contiguous:  # (np.ascontiguousarray makes a 0-d array 1-d)
            arr = np.array(arr, dtype=want, order="C")
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        arrays.append(arr)
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
        try:
            (size,) = struct.unpack("<Q", self._f.read(8))
            header = json.loads(self._f.read(size))
        except (struct.error, ValueError) as e:
            self._f.close()
            raise InvalidArgumentError(f"{self.path}: not a safetensors file ({e})") from e
        self._meta: dict[str, str] = header.pop("__metadata__", None) or {}
        self._entries: dict[str, dict[str, Any]] = header
        self._base = 8 + size

    def __enter__(self) -> TensorFile:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Close the file."""
        self._f.close()

    def metadata(self) -> dict[str, str]:
        """The header's string metadata."""
        return self._meta

    def keys(self) -> list[str]:
        """Tensor names in the file."""
        return list(self._entries)

    def get(self, name: str) -> np.ndarray:
        """The named tensor as a new writable, C-contiguous array read straight from the file."""
        entry = self._entries[name]
        shape, (begin, end) = tuple(int(d) for d in entry["shape"]), entry["data_offsets"]
        arr = np.empty(shape, np.dtype(_CODES[str(entry["dtype"])]).newbyteorder("<"))
        if arr.nbytes != end - begin:
            raise InvalidArgumentError(f"{self.path}: tensor {name!r} holds {end - begin} bytes for shape {shape}")
        flat = arr.reshape(-1).view(np.uint8)
        self._f.seek(self._base + begin)
        done = 0
        while done < flat.size:
            got = self._f.readinto(flat[done:done + _CHUNK].data)
            if not got:
                raise InvalidArgumentError(f"{self.path}: tensor {name!r} is cut short at byte {done}")
            done += got
        return arr
