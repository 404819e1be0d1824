"""Minimal safetensors reader (memory-mapped, lazy) and streaming writer.

Written here rather than through `safetensors.numpy` because numpy has no
bfloat16 of its own: we map BF16 to `ml_dtypes.bfloat16`, read only the slices a
device needs, and write tensor by tensor without holding a whole shard.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterable

import ml_dtypes
import numpy as np

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class SafetensorsFile:
    """Lazy view of one `.safetensors` file: `f[name]` is a read-only memory-mapped array."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError(f"{path}: not a safetensors file (shorter than its header length)")
            (n,) = struct.unpack("<Q", raw)
            try:
                header = json.loads(fh.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self._offset = 8 + n
        # A truncated file (an interrupted copy or download) is refused whole, naming the first
        # tensor it cuts, before any of it is read.
        size = os.path.getsize(path)
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][1]):
            start, end = info["data_offsets"]
            if self._offset + end > size:
                raise ValueError(f"{path}: truncated: tensor {name!r} needs bytes {self._offset + start}..{self._offset + end} "
                                 f"of the file, which has {size} ({self._offset + end - size} missing)")
        self._mmap = np.memmap(path, dtype=np.uint8, mode="r")

    def keys(self) -> list[str]:
        return list(self.header)

    def __contains__(self, name: str) -> bool:
        return name in self.header

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise ValueError(f"{self.path}: tensor {name!r} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        dtype = DTYPES[info["dtype"]]
        want = int(np.prod(info["shape"], dtype=np.int64)) * dtype.itemsize
        if end - start != want:
            raise ValueError(f"{self.path}: tensor {name!r} ({info['dtype']}{list(info['shape'])}) needs {want} bytes, "
                             f"its header gives it {end - start}")
        buf = self._mmap[self._offset + start:self._offset + end]
        return buf.view(dtype).reshape(info["shape"])


def write_safetensors(path: str, tensors: Iterable[tuple[str, tuple[int, ...], np.dtype]],
                      fetch: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> int:
    """Write tensors given as (name, shape, dtype), pulling each with `fetch(name)` in turn.

    The header needs every offset up front, which shapes and dtypes give without the
    data; so only one tensor is in host memory at a time. Written to a temporary
    name and renamed, so a failed write never leaves a half file behind. Returns bytes written.
    """
    header: dict = {"__metadata__": metadata or {"format": "pt"}}
    offset = 0
    order = []
    for name, shape, dtype in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": DTYPE_NAMES[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        order.append((name, tuple(shape), np.dtype(dtype)))
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the reference writer does
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(struct.pack("<Q", len(blob)))
        fh.write(blob)
        for name, shape, dtype in order:
            arr = np.ascontiguousarray(fetch(name))
            if arr.shape != shape or arr.dtype != dtype:
                raise ValueError(f"{path}: tensor {name!r} is {arr.dtype}{arr.shape}, "
                                 f"planned {dtype}{shape}")
            fh.write(arr.tobytes())
    os.replace(tmp, path)
    return offset
