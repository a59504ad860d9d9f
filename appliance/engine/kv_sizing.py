"""How many tokens the KV pool holds: from a token count, a memory size, or a share of free RAM.

Light on purpose (no numpy): the settings check --kv-cache-memory with parse_memory before
any model loads.
"""
from __future__ import annotations

import os
import re

# Without --kv-cache-memory the pool takes this share of the memory left once the weights are
# resident, keeping RESERVE_BYTES for the OS, the server and the page cache of the disk tier...
DEFAULT_SHARE = 0.5
RESERVE_BYTES = 512 << 20
# ...and holds between one context and this many: enough for a full batch at full context and
# as much again of idle conversations for the prefix cache; more would only commit memory.
DEFAULT_MAX_CONTEXTS = 16

_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_SHARE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*%\s*$")


def parse_memory(text: str) -> tuple[str, float]:
    """'4G', '1536MiB', '2147483648' -> ('bytes', n); '40%' -> ('share', 0.4) of available memory."""
    m = _SHARE.match(text)
    if m:
        share = float(m.group(1)) / 100
        if not 0 < share <= 1:
            raise ValueError(f"{text!r}: a share of memory must be above 0% and at most 100%")
        return "share", share
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"{text!r}: expected a size such as 4G, 1536M or 2147483648, or a share such as 40%")
    n = float(m.group(1)) * _UNITS[m.group(2).lower()]
    if n < 1 << 20:
        raise ValueError(f"{text!r}: at least 1M")
    return "bytes", n


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (what can be had without swapping), else physical memory."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def pool_tokens(bytes_per_token: int, max_context: int, kv_cache_tokens: int | None = None,
                kv_cache_memory: str | None = None, weight_bytes: int = 0,
                available: int | None = None) -> tuple[int, str]:
    """(tokens, how they were chosen). An explicit size below one context is an error: a
    sequence must be able to reach the context it is promised."""
    if kv_cache_tokens is not None and kv_cache_memory is not None:
        raise ValueError("set the KV pool by tokens or by memory, not both")
    if kv_cache_tokens is not None:
        tokens, how = int(kv_cache_tokens), f"{kv_cache_tokens} tokens asked"
    elif kv_cache_memory is not None:
        kind, value = parse_memory(kv_cache_memory)
        if kind == "share":
            value *= available if available is not None else available_memory_bytes()
        tokens, how = int(value // bytes_per_token), f"{kv_cache_memory} of memory"
    else:
        free = (available if available is not None else available_memory_bytes()) - weight_bytes - RESERVE_BYTES
        tokens = int(max(0, free) * DEFAULT_SHARE // bytes_per_token)
        tokens = max(max_context, min(tokens, DEFAULT_MAX_CONTEXTS * max_context))
        return tokens, (f"{int(DEFAULT_SHARE * 100)}% of the memory free after the weights, "
                        f"between 1 and {DEFAULT_MAX_CONTEXTS} contexts")
    if tokens < max_context:
        raise ValueError(f"the KV pool ({how}: {tokens} tokens) is smaller than the context ({max_context} "
                         f"tokens): raise it or lower the context")
    return tokens, how
