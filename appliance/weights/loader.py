"""A checkpoint directory's tensors -> our packed tensors, through an on-disk quantized cache.

First load: read the (possibly sharded) safetensors files through mmap, check every
tensor the model family's plan names, quantize the linear layers (Q8_0 or Q4_0)
with a progress bar, write them to one cache file and map that. Later loads map
the cache directly: no quantization, no copy, pages come in as they are touched.

The cache is keyed by the identity of the source files (name, size, mtime of
config.json and every *.safetensors) and the format; a changed file gives a new
key, so a stale cache is never used. It lives in <model>/.appliance-cache/, or in
$APPLIANCE_CACHE_DIR (default ~/.cache/appliance) when the model dir is read-only.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from appliance.kernels import quant
from appliance.options import WEIGHT_FORMATS
from appliance.errors import ModelLoadError
from appliance.weights.spec import TensorSpec
from appliance.weights.safetensors_io import SafetensorsFile, to_float32, write_safetensors_stream

CACHE_VERSION = "1"


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

    def float32(self, spec: TensorSpec) -> np.ndarray:
        """The spec's tensor as float32, sources stacked along the first axis."""
        parts = []
        for src in spec.sources:
            f = self.location[src]
            parts.append(to_float32(f.tensor(src), f.dtype_name(src)))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def _progress(done: int, total: int, label: str, start: float) -> None:
    if not sys.stderr.isatty() and done not in (0, total):
        return
    width = 30
    filled = int(width * done / max(total, 1))
    end = "\n" if done == total else ""
    sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tensors "
                     f"{time.perf_counter() - start:5.1f}s{end}")
    sys.stderr.flush()


def _packed_format(spec: TensorSpec, fmt: str) -> str:
    return "q8" if (spec.kind == "embedding" or spec.at_least_q8) else fmt


def _layout(spec: TensorSpec, fmt: str) -> list[tuple[str, np.dtype, tuple]]:
    """(name, dtype, shape) of the arrays `spec` becomes in the cache."""
    if spec.kind == "vector":
        return [(spec.name, np.dtype(np.float32), tuple(spec.shape))]
    n, k = spec.shape
    qs = (np.dtype(np.int8), (n, k)) if _packed_format(spec, fmt) == "q8" else (np.dtype(np.uint8), (n, k // 2))
    return [(spec.name + ".qs", *qs), (spec.name + ".d", np.dtype(np.float16), (n, k // quant.QK))]


def _pack(spec: TensorSpec, w: np.ndarray, fmt: str) -> list[np.ndarray]:
    if spec.kind == "vector":
        return [w.astype(np.float32).reshape(spec.shape)]
    packer = quant.quantize_q8_0 if _packed_format(spec, fmt) == "q8" else quant.quantize_q4_0
    return list(packer(w))


def _cache_candidates(model_dir: Path, key: str, fmt: str) -> list[Path]:
    name = f"{fmt}-{key}.safetensors"
    home_cache = Path(os.environ.get("APPLIANCE_CACHE_DIR") or Path.home() / ".cache" / "appliance")
    return [model_dir / ".appliance-cache" / name, home_cache / model_dir.name / name]


def _open_cache(path: Path, key: str, fmt: str, plan: list[TensorSpec]) -> dict | None:
    try:
        f = SafetensorsFile(path)
    except (ModelLoadError, OSError):
        return None
    meta = f.metadata
    if meta.get("appliance_cache") != CACHE_VERSION or meta.get("identity") != key or meta.get("format") != fmt:
        return None
    tensors = {name: f.tensor(name) for name in f.keys()}
    needed = {s.name for s in plan if s.kind == "vector"} | {s.name + ".qs" for s in plan if s.kind != "vector"}
    return tensors if needed <= tensors.keys() else None


def load_tensors(model_dir: Path, plan: list[TensorSpec], fmt: str, progress: bool = True) -> dict[str, np.ndarray]:
    """Our tensors for `plan` in weights format `fmt` ("q8", "q4", "f32")."""
    if fmt not in WEIGHT_FORMATS:
        raise ValueError(f"unknown weights format {fmt!r} (choose from {', '.join(WEIGHT_FORMATS)})")
    ckpt = Checkpoint(model_dir)
    for spec in plan:
        ckpt.check(spec)
    if fmt == "f32":
        return {spec.name: ckpt.float32(spec) for spec in plan}

    key = ckpt.identity()
    candidates = _cache_candidates(Path(model_dir), key, fmt)
    for path in candidates:
        if path.exists():
            cached = _open_cache(path, key, fmt, plan)
            if cached is not None:
                return cached

    meta = {"appliance_cache": CACHE_VERSION, "identity": key, "format": fmt}
    layout = [entry for spec in plan for entry in _layout(spec, fmt)]
    for path in candidates:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_safetensors_stream(path, layout, _quantized(ckpt, plan, fmt, progress), meta)
        except OSError:
            continue
        cached = _open_cache(path, key, fmt, plan)
        if cached is not None:
            _remove_stale(path, key)
            return cached
    # No writable cache location: quantize into memory (next load quantizes again).
    arrays = _quantized(ckpt, plan, fmt, progress)
    return {name: array for (name, _, _), array in zip(layout, arrays)}


def _quantized(ckpt: Checkpoint, plan: list[TensorSpec], fmt: str, progress: bool):
    """The packed arrays of every spec, in layout order, one tensor in memory at a time."""
    start = time.perf_counter()
    label = f"quantizing {ckpt.dir.name} to {fmt}"
    for i, spec in enumerate(plan):
        if progress:
            _progress(i, len(plan), label, start)
        yield from _pack(spec, ckpt.float32(spec), fmt)
    if progress:
        _progress(len(plan), len(plan), label, start)


def _remove_stale(fresh: Path, key: str) -> None:
    """Older cache files of this model (other source identities) only waste disk."""
    for old in fresh.parent.glob("*.safetensors"):
        if key not in old.name:
            try:
                old.unlink()
            except OSError:
                pass
