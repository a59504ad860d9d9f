"""Per-step timings as plain stats objects.

The engine fills these; it knows nothing of Prometheus. `appliance.metrics`
(server side) and `appliance bench` read them. With APPLIANCE_PROFILE=1 each
step is also logged in the one-line format of docs/engine.md ("Profiling").
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field

log = logging.getLogger("appliance.profile")


@dataclass
class PrefillStats:
    n_tokens: int            # prompt tokens computed in this prefill
    n_context: int           # context length after it
    total_s: float = 0.0
    gemm_s: float = 0.0      # quantize + GEMM (all linear layers, lm_head included)
    attn_s: float = 0.0      # attention over the KV cache, KV writes included

    @property
    def attn_share(self) -> float:
        return self.attn_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def gemm_share(self) -> float:
        return self.gemm_s / self.total_s if self.total_s > 0 else 0.0

    def log_line(self) -> str:
        return (f"[prefill] n={self.n_tokens} total_s={self.total_s:.3f} "
                f"gemm={100 * self.gemm_share:.1f}% attn={100 * self.attn_share:.1f}%")


@dataclass
class DecodeStats:
    batch: int               # sequences decoded together in this step
    n_context: int           # longest context among them (tokens in the cache)
    total_s: float = 0.0
    gemm_s: float = 0.0
    attn_s: float = 0.0
    contexts: list[int] = field(default_factory=list)  # context length of each sequence
    # tokens each sequence got (speculative decoding lands several in one step); empty: one each
    tokens: list[int] = field(default_factory=list)

    @property
    def attn_share(self) -> float:
        return self.attn_s / self.total_s if self.total_s > 0 else 0.0

    @property
    def rest_s(self) -> float:
        """The step outside its GEMMs and attention: norms, RoPE, SiLU, sampling and the Python
        around them (the fixed cost a step pays whatever the weights and the context)."""
        return max(0.0, self.total_s - self.gemm_s - self.attn_s)

    def log_line(self) -> str:
        return (f"[decode] n={self.n_context} total_ms={1e3 * self.total_s:.2f} "
                f"attn_ms={1e3 * self.attn_s:.2f} gemm_ms={1e3 * self.gemm_s:.2f} rest_ms={1e3 * self.rest_s:.2f}")


@dataclass
class VisionStats:
    n_images: int            # images encoded for one sequence
    n_patches: int           # vision-tower rows (patches) over all of them
    n_tokens: int            # image tokens they became in the prompt
    total_s: float = 0.0
    gemm_s: float = 0.0
    attn_s: float = 0.0

    def log_line(self) -> str:
        return (f"[vision] images={self.n_images} patches={self.n_patches} tokens={self.n_tokens} "
                f"total_s={self.total_s:.3f} gemm_s={self.gemm_s:.3f} attn_s={self.attn_s:.3f}")


class _Section:
    """One named section of a step, a reusable context manager: a decode step enters about 140
    of them, and a generator-based one cost ~3 us each against ~1 us here. Entered again while
    open, it counts the time once."""

    __slots__ = ("seconds", "_depth", "_t0")

    def __init__(self) -> None:
        self.seconds = 0.0
        self._depth = 0
        self._t0 = 0.0

    def __enter__(self) -> "_Section":
        if self._depth == 0:
            self._t0 = time.perf_counter()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> bool:
        self._depth -= 1
        if self._depth == 0:
            self.seconds += time.perf_counter() - self._t0
        return False


class StepTimer:
    """Accumulates time spent in named sections ('gemm', 'attn') during one step."""

    __slots__ = ("_gemm", "_attn")

    def __init__(self) -> None:
        self._gemm = _Section()
        self._attn = _Section()

    def gemm(self) -> _Section:
        return self._gemm

    def attn(self) -> _Section:
        return self._attn

    @property
    def gemm_s(self) -> float:
        return self._gemm.seconds

    @property
    def attn_s(self) -> float:
        return self._attn.seconds


def profiling_enabled() -> bool:
    return os.environ.get("APPLIANCE_PROFILE", "") not in ("", "0", "false", "no")


def emit(stats: PrefillStats | DecodeStats | VisionStats) -> None:
    """Log one line per step when APPLIANCE_PROFILE is set."""
    if profiling_enabled():
        log.info(stats.log_line())
