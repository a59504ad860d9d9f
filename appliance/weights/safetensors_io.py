"""Safetensors files, memory-mapped: names -> numpy views, no copies.

Format: u64 little-endian header length, a JSON header
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}},
then the raw tensor bytes (offsets relative to the end of the header).
We parse it ourselves so that every defect (truncation, bad JSON, offsets out of
range) becomes a one-line ModelLoadError naming the file, and so that tensors
stay views into one read-only mmap per file.
"""
from __future__ import annotations

import json
import mmap
import os
import struct
import zlib
from pathlib import Path

import numpy as np

from appliance.errors import ModelLoadError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": np.uint16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
    "BOOL": np.bool_,
}
NUMPY_TO_SAFETENSORS = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
                        np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8",
                        np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}
MAX_HEADER = 100 * 1024 * 1024
CHECKSUMS_KEY = "crc32"     # metadata: JSON {tensor name: 8 hex digits}, written by write_safetensors_stream
VERIFY_CHUNK = 16 << 20     # bytes read at a time when verifying


class SafetensorsFile:
    """One mapped file. `tensor(name)` returns a read-only view; BF16 comes back as uint16 bits."""

    def __init__(self, path: Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                size = self.path.stat().st_size
                if size < 8:
                    raise ModelLoadError(self.path, f"truncated safetensors file ({size} bytes)")
                (header_len,) = struct.unpack("<Q", f.read(8))
                if header_len > MAX_HEADER or 8 + header_len > size:
                    raise ModelLoadError(self.path, f"corrupt safetensors header (length {header_len} "
                                                    f"in a file of {size} bytes)")
                try:
                    header = json.loads(f.read(header_len))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:
                    raise ModelLoadError(self.path, f"corrupt safetensors header ({e})") from None
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else None
        except OSError as e:
            raise ModelLoadError(self.path, e.strerror or str(e)) from None
        if not isinstance(header, dict):
            raise ModelLoadError(self.path, "corrupt safetensors header (not a JSON object)")
        self.metadata: dict = header.pop("__metadata__", None) or {}
        self._data_start = 8 + header_len
        self._entries = header
        self._buffer = memoryview(self._map)
        data_len = size - self._data_start
        for name, entry in header.items():
            self._check_entry(name, entry, data_len)

    def _check_entry(self, name: str, entry, data_len: int) -> None:
        try:
            dtype = np.dtype(DTYPES[entry["dtype"]])
            shape = [int(d) for d in entry["shape"]]
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(self.path, f"tensor {name!r} has an unreadable header entry {entry!r}") from None
        expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if end - begin != expected or begin < 0:
            raise ModelLoadError(self.path, f"tensor {name!r}: {end - begin} bytes for shape {shape}")
        if end > data_len:
            raise ModelLoadError(self.path, f"truncated: tensor {name!r} ends at byte {end} "
                                            f"but the file holds {data_len} data bytes")

    def keys(self):
        return self._entries.keys()

    def dtype_name(self, name: str) -> str:
        return self._entries[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def checksums(self) -> dict[str, str] | None:
        """The CRC-32 of every tensor as written (None: a file without them)."""
        raw = self.metadata.get(CHECKSUMS_KEY)
        try:
            sums = json.loads(raw) if isinstance(raw, str) else None
        except ValueError:
            return None
        return sums if isinstance(sums, dict) else None

    def corrupt_tensors(self) -> list[str]:
        """Names of tensors whose bytes no longer match their recorded CRC-32 (all of them if the
        file records none). Reads with pread, not through the map: checking a model does not make
        its pages resident in this process."""
        sums = self.checksums()
        if sums is None or set(sums) != set(self._entries):
            return sorted(self._entries)
        bad, buf = [], bytearray(VERIFY_CHUNK)
        view = memoryview(buf)
        with open(self.path, "rb", buffering=0) as f:
            for name, entry in self._entries.items():
                begin, end = entry["data_offsets"]
                crc, pos, stop = 0, self._data_start + begin, self._data_start + end
                while pos < stop:
                    n = os.preadv(f.fileno(), [view[:min(VERIFY_CHUNK, stop - pos)]], pos)
                    if n <= 0:
                        break
                    crc = zlib.crc32(view[:n], crc)
                    pos += n
                if pos < stop or f"{crc & 0xFFFFFFFF:08x}" != sums[name]:
                    bad.append(name)
        return bad

    def tensor(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        begin, end = entry["data_offsets"]
        dtype = DTYPES[entry["dtype"]]
        raw = self._buffer[self._data_start + begin: self._data_start + end]
        return np.frombuffer(raw, dtype=dtype).reshape(entry["shape"])


def to_float32(array: np.ndarray, dtype_name: str) -> np.ndarray:
    """A tensor as float32 (a new array). BF16 bits are widened exactly as torch does."""
    if dtype_name == "BF16":
        return (array.astype(np.uint32) << 16).view(np.float32)
    return np.asarray(array, dtype=np.float32).copy() if array.dtype == np.float32 else array.astype(np.float32)


def write_safetensors_stream(path: Path, layout, arrays, metadata: dict[str, str]) -> dict[str, str]:
    """Write tensors whose (name, dtype, shape) are known up front, produced one at a time.

    The header is written first, then each array as `arrays` yields it, so a model
    larger than memory (a 30B MoE at 4 bits) is quantized with one tensor in RAM.
    Each tensor starts 64-byte aligned (our reader allows the gaps) so SIMD kernels get
    aligned rows straight from the mmap. The metadata gets CHECKSUMS_KEY: every tensor's
    CRC-32, patched into a header slot reserved at the start (same length, so no byte moves).
    Atomic: a temporary file of this process, flushed to disk, then renamed over `path`;
    a writer killed at any point leaves `path` as it was. Returns the checksums.
    """
    header, offset = {}, 0
    for name, dtype, shape in layout:
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        header[name] = {"dtype": NUMPY_TO_SAFETENSORS[np.dtype(dtype)], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes + (-nbytes) % 64
    checksums = {name: "0" * 8 for name, _, _ in layout}

    def header_blob() -> bytes:
        header["__metadata__"] = {**metadata, CHECKSUMS_KEY: json.dumps(checksums, separators=(",", ":"))}
        blob = json.dumps(header, separators=(",", ":")).encode()
        return blob + b" " * ((-(8 + len(blob))) % 64)

    blob = header_blob()
    tmp = path.with_name(f"{path.name}.partial.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for (name, dtype, shape), array in zip(layout, arrays):
                array = np.ascontiguousarray(array)
                if array.dtype != np.dtype(dtype) or array.shape != tuple(shape):
                    raise ValueError(f"{name}: produced {array.dtype}{array.shape}, declared {dtype}{tuple(shape)}")
                checksums[name] = f"{zlib.crc32(array.data) & 0xFFFFFFFF:08x}"
                f.write(array.data)
                f.write(b"\0" * ((-array.nbytes) % 64))
            final = header_blob()
            assert len(final) == len(blob), "checksum slots keep the header's length"
            f.seek(8)
            f.write(final)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return checksums


def _fsync_dir(directory: Path) -> None:
    """Make a rename durable: without it a power cut can lose the new directory entry."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
