"""What loading weights did, as plain data: the engine keeps it, the server's metrics count it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheReport:
    """What the quantized cache did during one load (plain data: the server counts it)."""

    path: str | None = None          # the cache file mapped, None: quantized into memory
    built: bool = False              # this load wrote it
    verify_s: float = 0.0            # time spent checking checksums
    hugepage_bytes: int = 0          # bytes of the streamed matrices copied into huge pages (hugepages.py)
    # (file, kind, why) for every cache file refused: kind "unreadable" (truncated, bad header),
    # "foreign" (another model, format or build), "corrupt" (a checksum or a tensor missing).
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
