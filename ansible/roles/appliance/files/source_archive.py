#!/usr/bin/env python3
"""Packs the appliance source tree into a reproducible release archive (controller side).

    source_archive.py SOURCE_DIR CACHE_DIR ENTRY [ENTRY ...]

Same files -> same bytes -> same release id (the first 16 hex digits of its SHA-256):
entries are sorted, owners and times are zeroed, build products are left out. Writes
CACHE_DIR/appliance-<id>.tar.gz unless it already exists and prints one JSON line:
{"release": id, "archive": path, "changed": bool, "files": n}.
"""
import gzip
import hashlib
import io
import json
import os
import sys
import tarfile

SKIP_DIRS = {"__pycache__", ".git", ".venv", "build", "dist", ".pytest_cache", ".appliance-cache"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".so", ".o", ".egg-info")


def wanted(path: str) -> bool:
    if path.endswith(SKIP_SUFFIXES):
        return False
    stem, ext = os.path.splitext(path)
    # C and C++ that Cython generates from a .pyx beside it are build products
    return not (ext in (".c", ".cpp") and os.path.exists(stem + ".pyx"))


def collect(source: str, entries: list[str]) -> list[str]:
    files = []
    for entry in entries:
        top = os.path.join(source, entry)
        if os.path.isfile(top):
            files.append(entry)
        for root, dirs, names in os.walk(top):
            dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info"))
            for name in names:
                full = os.path.join(root, name)
                if os.path.isfile(full) and wanted(full):
                    files.append(os.path.relpath(full, source))
    return sorted(set(files))


def main() -> None:
    source, cache, entries = sys.argv[1], sys.argv[2], sys.argv[3:]
    files = collect(source, entries)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel in files:
            info = tar.gettarinfo(os.path.join(source, rel), arcname=rel)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o755 if info.mode & 0o111 else 0o644
            with open(os.path.join(source, rel), "rb") as f:
                tar.addfile(info, f)
    release = hashlib.sha256(raw.getvalue()).hexdigest()[:16]
    os.makedirs(cache, exist_ok=True)
    archive = os.path.join(cache, f"appliance-{release}.tar.gz")
    changed = not os.path.exists(archive)
    if changed:
        tmp = archive + ".tmp"
        with open(tmp, "wb") as out, gzip.GzipFile(fileobj=out, mode="wb", mtime=0, filename="") as gz:
            gz.write(raw.getvalue())
        os.replace(tmp, archive)
    print(json.dumps({"release": release, "archive": archive, "changed": changed, "files": len(files)}))


if __name__ == "__main__":
    main()
