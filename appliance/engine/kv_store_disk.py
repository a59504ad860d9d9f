"""KV blocks on disk (docs/engine.md, "Prefix cache"): the prefix cache's second tier, across restarts.

One file per block, named by the block's hash, under a directory per cache root (the model,
its formats and attention settings):

    <dir>/<root hex>/<hash hex[:2]>/<hash hex>.kvb        (".imp.kvb": with sparse importance)

A file is
    magic b"APKVBLK\\0" | u32 format version | u32 header bytes | u32 CRC-32 of the header
    | header (JSON) | payload
and the header names the root, the block's hash, its parent's hash and its tokens, and lists
the payload's arrays (name, dtype, shape, offset) with the payload's size and CRC-32. Reading
checks all of it against what the pool expects: a file of another format version ("stale"),
of another root or layout ("foreign"), shorter than it says ("truncated") or failing a
checksum ("corrupt") is skipped with one log line, counted, and deleted; never loaded.

Files are written by one background thread through a temporary name and an atomic rename, so
a killed writer leaves the old file, the new one, or a `.partial` that the next start removes.
The directory is bounded (max_bytes): past it, the files least recently written or read go
first, whichever model they belong to.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from appliance.engine.prefix_cache import CACHE_FORMAT_VERSION, BlockMeta

log = logging.getLogger("appliance.kv_disk")

MAGIC = b"APKVBLK\0"
FIXED = struct.Struct("<III")        # format version, header bytes, header CRC-32
SUFFIX, IMPORTANCE_SUFFIX = ".kvb", ".imp.kvb"
PARTIAL_MAX_AGE_S = 600.0            # older .partial files are a killed writer's leftovers
REJECT_REASONS = ("stale", "foreign", "truncated", "corrupt")


@dataclass
class DiskStats:
    """The disk tier's counters (cumulative) and size."""

    files: int = 0
    bytes: int = 0
    max_bytes: int = 0
    written: int = 0              # blocks written
    loaded: int = 0               # blocks read back into the pool
    dropped: int = 0              # spills not written: the writer was behind, or the disk failed
    removed: int = 0              # files removed to stay under max_bytes
    rejected: dict = field(default_factory=lambda: {r: 0 for r in REJECT_REASONS})


@dataclass
class FileInfo:
    path: Path
    size: int
    importance: bool


class Rejected(Exception):
    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class DiskStore:
    """layout: {array name: (dtype, shape of one block)} as PagedKVCache.block_layout() gives it."""

    def __init__(self, directory, max_bytes: int, root: bytes, layout: dict, pending_bytes: int = 256 << 20):
        self.dir = Path(directory).expanduser()
        self.max_bytes = int(max_bytes)
        self.root = root
        self.root_dir = self.dir / root.hex()
        self.layout = {name: (np.dtype(dtype), tuple(shape)) for name, (dtype, shape) in layout.items()}
        self.pending_cap = pending_bytes
        self._lock = threading.Lock()              # index, sizes and counters
        self._index: dict[bytes, FileInfo] = {}    # this root's files
        self._sizes: dict[Path, tuple[float, int]] = {}   # every file under dir: (mtime, size)
        self._stats = DiskStats(max_bytes=self.max_bytes)
        self._pending = 0
        self._queue: queue.Queue = queue.Queue()
        try:
            self.root_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise OSError(f"KV cache directory {self.root_dir}: cannot create it ({e.strerror or e})") from None
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    # ---- index -----------------------------------------------------------------
    def _scan(self) -> None:
        now = time.time()
        for path in self.dir.rglob("*"):
            try:
                st = path.stat()
            except OSError:
                continue
            if not path.is_file():
                continue
            if ".partial" in path.name:
                if now - st.st_mtime > PARTIAL_MAX_AGE_S:
                    _unlink(path)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            self._sizes[path] = (st.st_mtime, st.st_size)
            if path.parent.parent == self.root_dir:
                name, has_importance = _parse_name(path.name)
                if name is None:
                    continue
                old = self._index.get(name)
                if old is not None and old.importance and not has_importance:
                    continue
                self._index[name] = FileInfo(path, st.st_size, has_importance)
        self._stats.files = len(self._sizes)
        self._stats.bytes = sum(size for _, size in self._sizes.values())
        self._trim()

    def find(self, name: bytes) -> FileInfo | None:
        with self._lock:
            return self._index.get(name)

    def wants(self, name: bytes, meta: BlockMeta) -> bool:
        """Would writing this block add something: it is not on disk, or only without its importance."""
        info = self.find(name)
        return info is None or (meta.importance is not None and not info.importance)

    def _path(self, name: bytes, importance: bool) -> Path:
        h = name.hex()
        return self.root_dir / h[:2] / (h + (IMPORTANCE_SUFFIX if importance else SUFFIX))

    # ---- writing ---------------------------------------------------------------
    def save(self, name: bytes, meta: BlockMeta, arrays: dict) -> bool:
        """Queue a block for the writer thread. arrays: copies (the pool block is reused at once).
        False when it was not queued: already on disk, or the writer is too far behind."""
        if not self.wants(name, meta):
            return False
        size = sum(a.nbytes for a in arrays.values())
        with self._lock:
            if self._pending + size > self.pending_cap:
                self._stats.dropped += 1
                return False
            self._pending += size
        self._queue.put((name, meta, arrays, size))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (True) or the timeout passes (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self._pending == 0 and self._queue.empty():
                    return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def _write_loop(self) -> None:
        while True:
            name, meta, arrays, size = self._queue.get()
            try:
                self._write(name, meta, arrays)
            except OSError as e:
                with self._lock:
                    self._stats.dropped += 1
                log.warning("KV cache: could not write a block to %s (%s)", self.root_dir, e.strerror or e)
            finally:
                with self._lock:
                    self._pending -= size

    def _write(self, name: bytes, meta: BlockMeta, arrays: dict) -> None:
        parts = dict(arrays)
        if meta.importance is not None:
            parts["importance"] = np.ascontiguousarray(meta.importance, dtype=np.float32)
        table, offset = [], 0
        for key, a in parts.items():
            table.append([key, a.dtype.str, list(a.shape), offset])
            offset += a.nbytes
        crc = 0
        for a in parts.values():
            crc = zlib.crc32(memoryview(np.ascontiguousarray(a)).cast("B"), crc)
        header = json.dumps({"root": self.root.hex(), "hash": name.hex(), "parent": meta.parent.hex(),
                             "tokens": [int(t) for t in meta.tokens], "arrays": table,
                             "payload_bytes": offset, "payload_crc32": crc},
                            separators=(",", ":")).encode()
        path = self._path(name, meta.importance is not None)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.partial")
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + FIXED.pack(CACHE_FORMAT_VERSION, len(header), zlib.crc32(header)) + header)
                for a in parts.values():
                    f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
            os.replace(tmp, path)
        except OSError:
            _unlink(tmp)
            raise
        st = path.stat()
        with self._lock:
            old = self._index.get(name)
            if old is not None and old.path != path:
                self._forget(old.path)
                _unlink(old.path)
            self._index[name] = FileInfo(path, st.st_size, meta.importance is not None)
            self._account(path, st.st_mtime, st.st_size)
            self._stats.written += 1
            self._trim()

    # ---- reading ---------------------------------------------------------------
    def load(self, name: bytes, parent: bytes, tokens, into: dict) -> BlockMeta | None:
        """Read the block `name` into the arrays `into` ({array name: the pool block's view}).
        None if there is no usable file; a rejected one is logged, counted and removed."""
        info = self.find(name)
        if info is None:
            return None
        try:
            meta = self._read(info.path, name, parent, tokens, into)
        except Rejected as e:
            self._reject(info, e.reason, str(e))
            return None
        except OSError as e:
            self._reject(info, "truncated", f"unreadable ({e.strerror or e})")
            return None
        now = time.time()
        try:
            os.utime(info.path, (now, now))           # least recently used goes first
        except OSError:
            pass
        with self._lock:
            self._account(info.path, now, info.size)
            self._stats.loaded += 1
        return meta

    def _read(self, path: Path, name: bytes, parent: bytes, tokens, into: dict) -> BlockMeta:
        with open(path, "rb") as f:
            data = f.read()
        fixed = len(MAGIC) + FIXED.size
        if len(data) < fixed:
            raise Rejected("truncated", f"{len(data)} bytes, shorter than the file's fixed header")
        if data[:len(MAGIC)] != MAGIC:
            raise Rejected("foreign", "not a KV block file")
        version, header_len, header_crc = FIXED.unpack_from(data, len(MAGIC))
        if version != CACHE_FORMAT_VERSION:
            raise Rejected("stale", f"format version {version}, this build reads {CACHE_FORMAT_VERSION}")
        if len(data) < fixed + header_len:
            raise Rejected("truncated", "the header is cut short")
        header_bytes = data[fixed:fixed + header_len]
        if zlib.crc32(header_bytes) != header_crc:
            raise Rejected("corrupt", "header checksum mismatch")
        try:
            header = json.loads(header_bytes)
        except ValueError:
            raise Rejected("corrupt", "unreadable header") from None
        if header.get("root") != self.root.hex():
            raise Rejected("foreign", "written for another model, format or attention setting")
        if header.get("hash") != name.hex() or header.get("parent") != parent.hex():
            raise Rejected("foreign", "the file holds another block")
        if [int(t) for t in header.get("tokens", ())] != [int(t) for t in tokens]:
            raise Rejected("foreign", "the block's tokens differ")
        payload = memoryview(data)[fixed + header_len:]
        if len(payload) < header["payload_bytes"]:
            raise Rejected("truncated", f"payload {len(payload)} of {header['payload_bytes']} bytes")
        if len(payload) > header["payload_bytes"] or zlib.crc32(payload) != header["payload_crc32"]:
            raise Rejected("corrupt", "payload checksum mismatch")
        arrays = {}
        for key, dtype, shape, offset in header["arrays"]:
            dtype, shape = np.dtype(dtype), tuple(shape)
            expect = self.layout.get(key)
            if key != "importance" and (expect is None or expect != (dtype, shape)):
                raise Rejected("foreign", f"array {key!r} is {dtype}{list(shape)}, the pool holds "
                               f"{expect[0] if expect else 'none'}{list(expect[1]) if expect else ''}")
            count = int(np.prod(shape))
            arrays[key] = np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)
        if set(self.layout) - set(arrays):
            raise Rejected("foreign", f"missing array {sorted(set(self.layout) - set(arrays))[0]!r}")
        for key, view in into.items():
            view[...] = arrays[key]
        importance = arrays.get("importance")
        return BlockMeta(parent, np.array(tokens, dtype=np.int32),
                         None if importance is None else importance.copy())

    def _reject(self, info: FileInfo, reason: str, detail: str) -> None:
        log.warning("KV cache file %s skipped (%s): %s", info.path, reason, detail)
        with self._lock:
            self._stats.rejected[reason] += 1
            name, _ = _parse_name(info.path.name)
            if name is not None and self._index.get(name) is info:
                del self._index[name]
            self._forget(info.path)
        _unlink(info.path)

    # ---- size bound ------------------------------------------------------------
    def _account(self, path: Path, mtime: float, size: int) -> None:
        old = self._sizes.get(path)
        self._sizes[path] = (mtime, size)
        self._stats.bytes += size - (old[1] if old else 0)
        self._stats.files = len(self._sizes)

    def _forget(self, path: Path) -> None:
        old = self._sizes.pop(path, None)
        if old is not None:
            self._stats.bytes -= old[1]
            self._stats.files = len(self._sizes)

    def _trim(self) -> None:
        """Past max_bytes, remove the least recently used files down to 90% of it (under the lock)."""
        if self._stats.bytes <= self.max_bytes:
            return
        target = int(0.9 * self.max_bytes)
        for path, _ in sorted(self._sizes.items(), key=lambda item: item[1][0]):
            if self._stats.bytes <= target:
                break
            self._forget(path)
            _unlink(path)
            self._stats.removed += 1
            if path.parent.parent == self.root_dir:
                name, _ = _parse_name(path.name)
                info = self._index.get(name)
                if info is not None and info.path == path:
                    del self._index[name]

    def stats(self) -> DiskStats:
        with self._lock:
            s = self._stats
            return DiskStats(files=s.files, bytes=s.bytes, max_bytes=s.max_bytes, written=s.written,
                             loaded=s.loaded, dropped=s.dropped, removed=s.removed, rejected=dict(s.rejected))


def _parse_name(filename: str) -> tuple[bytes | None, bool]:
    importance = filename.endswith(IMPORTANCE_SUFFIX)
    stem = filename[:-len(IMPORTANCE_SUFFIX if importance else SUFFIX)]
    try:
        name = bytes.fromhex(stem)
    except ValueError:
        return None, False
    return (name if len(name) > 0 else None), importance


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
