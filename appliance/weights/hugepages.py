"""The matrices every decode step streams, held in 2 MB pages instead of the cache file's 4 KB ones.

The weight cache is mapped from its file (loader.py), so its pages are the page cache's 4 KB
pages. A decode step streams every dense matrix once: with 4 KB pages that is a TLB miss, a page
walk and a restarted hardware prefetch stream every 4 KB. Copied once at load into anonymous
memory that the kernel backs with transparent huge pages (MADV_HUGEPAGE), the same GEMVs ran
17% faster: the Qwen3-0.6B shape's matrices, cold, 2 threads, Zen 4, 19.23 -> 15.89 ms a
pass for one row, 22.27 -> 18.94 for four (docs/performance.md).

Only the matrices a step reads whole are copied (Model.streamed_linears): a MoE layer's experts
stay mapped, so that an expert no token routes to is never read into memory. The copied ranges
of the file mapping are then dropped from this process (MADV_DONTNEED: the file's pages stay in
the page cache), so the process's RSS counts the weights once.

APPLIANCE_WEIGHT_HUGEPAGES=0 keeps every matrix mapped; so does a kernel without transparent
huge pages ("never" in /sys/kernel/mm/transparent_hugepage/enabled), or a process not allowed
to give the advice.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np

HUGE_PAGE = 2 << 20
ALIGN = 64                     # each copy starts on a cache line, as the strips' vector loads want
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def wanted() -> bool:
    """Whether streamed matrices should be copied into huge pages on this machine."""
    if os.environ.get("APPLIANCE_WEIGHT_HUGEPAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return False
    if "[always]" not in setting and "[madvise]" not in setting:
        return False
    try:   # a seccomp filter (a hardened unit's SystemCallFilter=) may refuse the advice
        with mmap.mmap(-1, mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as m:
            m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        return False
    return True


def is_mapped(a: np.ndarray) -> bool:
    """True for a view of the weight cache's mapping: the loader maps it read-only, and every
    array made in memory (quantized at load, or packed here) is writable."""
    return not a.flags.writeable


def arena(nbytes: int) -> np.ndarray:
    """uint8[nbytes] of anonymous memory advised for huge pages, starting on a 2 MB boundary (so the
    first huge page starts with it)."""
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(m, np.uint8)       # keeps the mapping alive as long as a view of it lives
    start = (-raw.ctypes.data) % HUGE_PAGE
    return raw[start:start + nbytes]


def copies(arrays: list[np.ndarray]) -> list[np.ndarray]:
    """Copies of `arrays`, side by side in one arena, each starting on a cache line. One arena, not
    one an array: a huge page is committed whole, so matrices rounded up one by one to 2 MB each
    took 30% more memory (Qwen3-0.6B: 190 MB over 603). The copies are writable, as this
    process's memory is: is_mapped tells them from the cache's mapping."""
    offsets, total = [], 0
    for a in arrays:
        offsets.append(total)
        total += -(-a.nbytes // ALIGN) * ALIGN
    buf = arena(total) if arrays else None
    out = []
    for a, off in zip(arrays, offsets):
        copy = buf[off:off + a.nbytes].view(a.dtype).reshape(a.shape)
        copy[...] = a
        out.append(copy)
    return out


def hold(linears) -> int:
    """Copy the mapped arrays of these Linear layers (their ws, or qs and d) into one arena
    (copies) and drop their mapped pages; the bytes copied. A copy is not mapped, so a matrix is
    never copied twice."""
    moves = [(lin, name, a) for lin in linears for name in ("ws", "qs", "d")
             if (a := getattr(lin, name)) is not None and is_mapped(a)]
    for (lin, name, a), copy in zip(moves, copies([a for _, _, a in moves])):
        setattr(lin, name, copy)
        release(a)
    return sum(a.nbytes for _, _, a in moves)


def release(a: np.ndarray) -> None:
    """Drop the whole pages of a mapped array from this process (the file's pages stay in the page
    cache; reading `a` again would map them back in). Only for the cache's read-only mapping: on
    this process's own memory MADV_DONTNEED would zero the pages."""
    if not is_mapped(a):
        raise ValueError("release: not a read-only view of a mapped file")
    page = mmap.PAGESIZE
    lo = -(-a.ctypes.data // page) * page
    hi = (a.ctypes.data + a.nbytes) // page * page
    if hi > lo:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), ctypes.c_int(mmap.MADV_DONTNEED))
