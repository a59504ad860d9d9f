"""A checkpoint directory's tensors -> our packed tensors, through an on-disk quantized cache.

First load: read the (possibly sharded) safetensors files through mmap, check every
tensor the model family's plan names, quantize the linear layers (Q8_0 or Q4_0)
with a progress bar, write them to one cache file and map that. Later loads map
the cache directly: no quantization, no copy, pages come in as they are touched. (The engine
then copies the matrices every decode step reads whole into huge pages: weights/hugepages.py.)

Quantized matrices are stored in the order this machine's GEMM reads them: as rows (qs, d), or,
where the GEMM has a micro-kernel for it (x86: AVX512-VNNI or plain AVX2), in strips (kernels/gemm_strips.h),
so that layout too is mapped without a copy and an expert that never runs is never read.

The cache is keyed by the identity of the source files (name, size, mtime of
config.json and every *.safetensors) and the format; a changed file gives a new
key, so a stale cache is never used. It lives in <model>/.appliance-cache/, or in
$APPLIANCE_CACHE_DIR (default ~/.cache/appliance) when the model dir is read-only.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from appliance.kernels import quant
from appliance.kernels import strips
from appliance.kernels.dispatch import kernels
from appliance.options import WEIGHT_FORMATS
from appliance.errors import ModelLoadError
from appliance.weights.report import CacheReport
from appliance.weights.linear import strips_wanted
from appliance.weights.spec import TensorSpec
from appliance.weights.safetensors_io import SafetensorsFile, to_float32, write_safetensors_stream

CACHE_VERSION = "2"          # 2: per-tensor CRC-32 and the quantizer's fingerprint in the metadata
PROGRESS_LOG_S = 5.0
LOCK_TIMEOUT_S = 3600.0      # a writer quantizing a 30B model on a board takes minutes, not hours
log = logging.getLogger("appliance.weights")
_INDEXED = re.compile(r"^(.*\b(?:layers|blocks)\.)(\d+)\.")     # "model.layers.12.mlp..." -> prefix, 12


class Checkpoint:
    """All safetensors files of a model directory, as one name -> tensor mapping."""

    def __init__(self, model_dir: Path):
        self.dir = Path(model_dir)
        index_path = self.dir / "model.safetensors.index.json"
        if index_path.exists():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise ModelLoadError(index_path, f"unreadable shard index ({e})") from None
            names = sorted(set(weight_map.values()))
        else:
            names = sorted(p.name for p in self.dir.glob("*.safetensors"))
            weight_map = None
        if not names:
            raise ModelLoadError(self.dir, "no *.safetensors weights found")
        self.files: dict[str, SafetensorsFile] = {}
        for name in names:
            path = self.dir / name
            if not path.exists():
                raise ModelLoadError(path, "missing shard named in model.safetensors.index.json")
            self.files[name] = SafetensorsFile(path)
        self.location: dict[str, SafetensorsFile] = {}
        for f in self.files.values():
            for key in f.keys():
                self.location[key] = f
        if weight_map:
            for key, name in weight_map.items():
                if key not in self.location:
                    raise ModelLoadError(self.dir / name, f"tensor {key!r} listed in the index is not in the file")

    def identity(self) -> str:
        """Hash of what the checkpoint is made of; it changes whenever a source file changes."""
        parts = []
        for path in [self.dir / "config.json"] + [f.path for f in self.files.values()]:
            st = path.stat()
            parts.append([path.name, st.st_size, st.st_mtime_ns])
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]

    def check(self, spec: TensorSpec) -> None:
        for src in spec.sources:
            if src not in self.location:
                raise ModelLoadError(self.dir, f"missing tensor {src!r} (needed for {spec.name})")
        rows = 0
        for src in spec.sources:
            f = self.location[src]
            shape = f.shape(src)
            want_tail = spec.shape[1:]
            if tuple(shape[1:]) != tuple(want_tail):
                raise ModelLoadError(f.path, f"tensor {src!r} has shape {list(shape)}, expected "
                                             f"[*, {', '.join(map(str, want_tail))}]" if want_tail else
                                             f"tensor {src!r} has shape {list(shape)}")
            rows += shape[0] if shape else 1
        if rows != spec.shape[0]:
            f = self.location[spec.sources[0]]
            expected = list(spec.shape) if len(spec.sources) == 1 else f"{spec.shape[0]} rows in all"
            raise ModelLoadError(f.path, f"tensor {spec.sources[0]!r}{' (+ fused)' if len(spec.sources) > 1 else ''} "
                                         f"has shape {list(f.shape(spec.sources[0]))}, expected {expected}")

    def check_unused_layers(self, plan: list[TensorSpec]) -> None:
        """A config.json that declares fewer layers (or vision blocks) than the checkpoint holds is
        refused: the model would run on part of its weights without a word."""
        highest: dict[str, int] = {}
        for spec in plan:
            for src in spec.sources:
                m = _INDEXED.match(src)
                if m:
                    highest[m.group(1)] = max(highest.get(m.group(1), -1), int(m.group(2)))
        for name in self.location:
            m = _INDEXED.match(name)
            if m and m.group(1) in highest and int(m.group(2)) > highest[m.group(1)]:
                count = highest[m.group(1)] + 1
                raise ModelLoadError(self.dir / "config.json",
                                     f"declares {count} {m.group(1).rstrip('.').rsplit('.', 1)[-1]} but the "
                                     f"checkpoint also holds {name!r}")

    def float32(self, spec: TensorSpec) -> np.ndarray:
        """The spec's tensor as float32, sources stacked along the first axis."""
        parts = []
        for src in spec.sources:
            f = self.location[src]
            parts.append(to_float32(f.tensor(src), f.dtype_name(src)))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


class Progress:
    """Quantization progress: a bar on a terminal, a log line every PROGRESS_LOG_S otherwise
    (a service has no terminal, and its log should still say the load is alive)."""

    def __init__(self, total: int, label: str, enabled: bool, on_progress=None):
        self.total, self.label, self.enabled, self.on_progress = total, label, enabled, on_progress
        self.start = self.last_log = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self.done = 0

    def advance(self, done: int) -> None:
        self.done = done
        if self.on_progress is not None:
            self.on_progress("quantizing", done, self.total)
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start
        if self.tty:
            filled = int(30 * done / max(self.total, 1))
            end = "\n" if done >= self.total else ""
            sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (30 - filled)}] {done}/{self.total} "
                             f"tensors {elapsed:5.1f}s{end}")
            sys.stderr.flush()
        elif done >= self.total or done == 0 or time.perf_counter() - self.last_log >= PROGRESS_LOG_S:
            self.last_log = time.perf_counter()
            log.info("%s: %d/%d tensors, %.1f s", self.label, done, self.total, elapsed)


def _packed_format(spec: TensorSpec, fmt: str) -> str:
    return "q8" if (spec.kind == "embedding" or spec.at_least_q8) else fmt


def _layout(spec: TensorSpec, fmt: str, order: str) -> list[tuple[str, np.dtype, tuple]]:
    """(name, dtype, shape) of the arrays `spec` becomes in the cache. `order` "rows": qs and d as
    stored by quant.py; "strips": one uint8 [strips, strip bytes] array (kernels/gemm_strips.h)."""
    if spec.kind == "vector":
        return [(spec.name, np.dtype(np.float32), tuple(spec.shape))]
    n, k = spec.shape
    q4 = _packed_format(spec, fmt) == "q4"
    if order == "strips":
        return [(spec.name + ".ws", np.dtype(np.uint8), (strips.strips_count(n), strips.strip_bytes(q4, k)))]
    qs = (np.dtype(np.uint8), (n, k // 2)) if q4 else (np.dtype(np.int8), (n, k))
    return [(spec.name + ".qs", *qs), (spec.name + ".d", np.dtype(np.float16), (n, k // quant.QK))]


def _pack(spec: TensorSpec, w: np.ndarray, fmt: str, order: str) -> list[np.ndarray]:
    if spec.kind == "vector":
        return [w.astype(np.float32).reshape(spec.shape)]
    q4 = _packed_format(spec, fmt) == "q4"
    qs, d = (quant.quantize_q4_0 if q4 else quant.quantize_q8_0)(w)
    if order == "rows":
        return [qs, d]
    return [kernels.pack_strips(qs, d, q4).reshape(strips.strips_count(spec.shape[0]), -1)]


def _with_shapes(tensors: dict, plan: list[TensorSpec], order: str) -> dict:
    """Strips are padded to 16 rows, so each matrix's (N, K) comes beside them, from the plan: in
    memory, not in the file (a read there would fault in the pages around it, an expert's too)."""
    if order == "strips":
        for spec in plan:
            if spec.kind != "vector":
                tensors[spec.name + ".shape"] = np.array(spec.shape, np.int64)
    return tensors


def quantizer_fingerprint() -> str:
    """Changes whenever the code that packs tensors does (quant.py, and strips.py, the strips
    layout's definition, which the compiled packer is tested against; the rest of the layout is
    CACHE_VERSION): a cache written by another build is not used."""
    digest = hashlib.sha256(Path(quant.__file__).read_bytes())
    digest.update(Path(strips.__file__).read_bytes())
    return digest.hexdigest()[:16]


def cache_dir(model_dir: Path) -> Path:
    """Where this model's cache lives: <model>/.appliance-cache if it can be written, else
    $APPLIANCE_CACHE_DIR (default ~/.cache/appliance)/<model name>. One place per model, decided
    by permissions, never by a failed write: a full disk is an error, not a second copy."""
    local = Path(model_dir) / ".appliance-cache"
    if local.is_dir() and os.access(local, os.W_OK | os.X_OK):
        return local
    if not local.exists() and os.access(model_dir, os.W_OK | os.X_OK):
        return local
    home = Path(os.environ.get("APPLIANCE_CACHE_DIR") or Path.home() / ".cache" / "appliance")
    return home.expanduser() / Path(model_dir).name


def cache_order() -> str:
    """How quantized matrices are stored for this machine: "strips" where its GEMM has a
    micro-kernel for them (weights.linear.strips_wanted), else "rows"."""
    return "strips" if strips_wanted() else "rows"


def cache_path(model_dir: Path, fmt: str, key: str, order: str) -> Path:
    """One file per (sources, format, order): a machine that switches order keeps both, and a
    rows cache keeps the name it always had."""
    return cache_dir(Path(model_dir)) / (f"{fmt}-{key}.safetensors" if order == "rows"
                                         else f"{fmt}-{order}-{key}.safetensors")


def _expected_meta(key: str, fmt: str, order: str) -> dict[str, str]:
    meta = {"appliance_cache": CACHE_VERSION, "identity": key, "format": fmt,
            "quantizer": quantizer_fingerprint()}
    if order != "rows":                # rows caches written before there was a choice stay valid
        meta["order"] = order
    return meta


def _open_cache(path: Path, key: str, fmt: str, order: str, plan: list[TensorSpec],
                report: CacheReport) -> dict | None:
    """The cache's tensors if it is this model's, this build's and intact; else None (and why)."""
    try:
        f = SafetensorsFile(path)
    except ModelLoadError as e:
        report.rejected.append((str(path), "unreadable", e.problem))
        return None
    meta = f.metadata
    for k, v in _expected_meta(key, fmt, order).items():
        if meta.get(k) != v:
            report.rejected.append((str(path), "foreign", f"{k} {meta.get(k)!r} is not {v!r}"))
            return None
    tensors = {name: f.tensor(name) for name in f.keys()}
    needed = {n for spec in plan for n, _, _ in _layout(spec, fmt, order)}
    if not needed <= tensors.keys():
        report.rejected.append((str(path), "corrupt", f"missing tensor {sorted(needed - tensors.keys())[0]!r}"))
        return None
    t0 = time.perf_counter()
    bad = f.corrupt_tensors()
    report.verify_s += time.perf_counter() - t0
    if bad:
        report.rejected.append((str(path), "corrupt", f"checksum mismatch in {len(bad)} tensor(s), first {bad[0]!r}"))
        return None
    return _with_shapes(tensors, plan, order)


@contextmanager
def _writer_lock(path: Path):
    """One writer per cache file across processes; the others wait here, then map its result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a+") as lock:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        waited = False
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waited:
                    log.info("waiting for another process writing %s", path)
                    waited = True
                if time.monotonic() > deadline:
                    raise ModelLoadError(path, f"another process has held the cache lock for "
                                               f"{LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def load_tensors(model_dir: Path, plan: list[TensorSpec], fmt: str, progress: bool = True,
                 report: CacheReport | None = None, on_progress=None) -> dict[str, np.ndarray]:
    """Our tensors for `plan` in weights format `fmt` ("q8", "q4", "f32").

    on_progress(stage, done, total), if given, hears each stage ("reading", "verifying",
    "quantizing") as it goes: a server's /health reports it while the model loads."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights format {fmt!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    report = report if report is not None else CacheReport()
    tell = on_progress or (lambda stage, done, total: None)
    tell("reading", 0, len(plan))
    ckpt = Checkpoint(model_dir)
    for spec in plan:
        ckpt.check(spec)
    ckpt.check_unused_layers(plan)
    if fmt == "f32":
        return {spec.name: ckpt.float32(spec) for spec in plan}

    key, order = ckpt.identity(), cache_order()
    path = cache_path(model_dir, fmt, key, order)
    refused = None                   # (inode, mtime) of a cache file found unusable
    if path.exists():
        tell("verifying", 0, len(plan))
        cached = _open_cache(path, key, fmt, order, plan, report)
        if cached is not None:
            report.path = str(path)
            return cached
        _log_rejected(report)
        refused = _file_id(path)
    layout = [entry for spec in plan for entry in _layout(spec, fmt, order)]
    try:
        with _writer_lock(path):
            # Another process may have written it while this one waited for the lock.
            if path.exists() and _file_id(path) != refused:
                cached = _open_cache(path, key, fmt, order, plan, report)
                if cached is not None:
                    report.path = str(path)
                    return cached
            _remove_leftovers(path, key)
            _check_space(path, layout)
            write_safetensors_stream(path, layout, _quantized(ckpt, plan, fmt, order, progress, on_progress),
                                     _expected_meta(key, fmt, order))
            report.built = True
            cached = _open_cache(path, key, fmt, order, plan, report)
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EACCES, errno.EROFS, errno.EDQUOT):
            raise ModelLoadError(path, f"cannot write the weight cache ({e.strerror or e})") from None
        # The server still starts: quantized into memory, the next load quantizes again.
        log.error("%s", e.strerror if isinstance(e, _NoSpace) else f"cannot write the weight cache {path}: "
                  f"{e.strerror or e}; quantizing into memory instead")
        arrays = _quantized(ckpt, plan, fmt, order, progress, on_progress)
        return _with_shapes({name: array for (name, _, _), array in zip(layout, arrays)}, plan, order)
    if cached is None:
        _log_rejected(report)
        raise ModelLoadError(path, "the weight cache just written does not read back intact (failing disk?)")
    report.path = str(path)
    return cached


class _NoSpace(OSError):
    pass


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _check_space(path: Path, layout) -> None:
    """Refuse before writing when the cache cannot fit: one line naming the directory and the bytes."""
    need = sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize + 64 for _, dtype, shape in layout)
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise _NoSpace(errno.ENOSPC, f"no room for the weight cache in {path.parent}: {need} bytes needed, "
                                     f"{free} free; quantizing into memory instead")


def _log_rejected(report: CacheReport) -> None:
    for file, kind, why in report.rejected:
        log.warning("weight cache %s not used (%s: %s): rebuilding it", file, kind, why)


def _remove_leftovers(path: Path, key: str) -> None:
    """Under the writer lock: partial files of killed writers, and caches of this model's older
    sources (another identity) that only waste disk. Never a file another process maps for this key."""
    for old in path.parent.glob("*.safetensors*"):
        stale = key not in old.name or ".partial." in old.name or old == path
        if stale and not old.name.endswith(".lock"):
            try:
                old.unlink()
            except OSError:
                pass


def _quantized(ckpt: Checkpoint, plan: list[TensorSpec], fmt: str, order: str, progress: bool, on_progress=None):
    """The packed arrays of every spec, in layout order, one tensor in memory at a time."""
    bar = Progress(len(plan), f"quantizing {ckpt.dir.name} to {fmt}", progress, on_progress)
    bar.advance(0)
    for i, spec in enumerate(plan):
        packed = _pack(spec, ckpt.float32(spec), fmt, order)
        bar.advance(i + 1)          # before the last yield: a consumer stops at the last array
        yield from packed


def verify_cache(model_dir, fmt: str, plan: list[TensorSpec]) -> dict:
    """{"ok", "path", "problem" or "detail"}: is the cache a load of (model_dir, fmt) would map intact?
    No cache yet is fine (the first load writes one); a refused one is not."""
    ckpt = Checkpoint(Path(model_dir))
    key, order = ckpt.identity(), cache_order()
    path = cache_path(model_dir, fmt, key, order)
    if not path.exists():
        return {"ok": True, "path": None, "detail": f"no {fmt} cache yet: the first load writes {path}"}
    report = CacheReport()
    t0 = time.perf_counter()
    if _open_cache(path, key, fmt, order, plan, report) is None:
        _, kind, why = report.rejected[0]
        if kind == "foreign":        # another build's or sources': not damage, the next load rebuilds it
            return {"ok": True, "path": str(path), "detail": f"stale ({why}): the next load rebuilds it"}
        return {"ok": False, "path": str(path), "problem": f"{kind}: {why}"}
    return {"ok": True, "path": str(path), "detail": f"{path.stat().st_size} bytes verified in "
                                                     f"{time.perf_counter() - t0:.2f} s"}
