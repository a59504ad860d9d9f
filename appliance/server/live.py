"""Short in-memory history for the dashboard (Prometheus keeps the long one).

Fed by the same stats objects as appliance.metrics: decode steps become points
(time, ms/token, attention share, context, batch); tokens and queue depth are
summed into one-second buckets. Everything is bounded: a board serves for months.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from appliance.engine.stats import DecodeStats, PrefillStats
from appliance.server.scheduler import StepTokens


class LiveStats:
    def __init__(self, seconds: int = 300, points: int = 600,
                 queue_state: Callable[[], tuple[int, int]] | None = None):
        self.lock = threading.Lock()
        self.steps: collections.deque[dict] = collections.deque(maxlen=points)
        self.prefills: collections.deque[dict] = collections.deque(maxlen=points // 4)
        self.buckets: collections.deque[dict] = collections.deque(maxlen=seconds)
        self.queue_state = queue_state or (lambda: (0, 0))
        self._current: dict | None = None

    def _bucket(self, now: float) -> dict:
        """The bucket for the current second, closing (and zero-filling) past ones."""
        second = int(now)
        cur = self._current
        if cur is not None and cur["t"] == second:
            return cur
        if cur is not None:
            self._close(cur)
            gap_start = cur["t"] + 1
            if second - gap_start > self.buckets.maxlen:
                gap_start = second - self.buckets.maxlen
            running, waiting = self.queue_state()
            for t in range(gap_start, second):     # idle seconds still show on the chart
                self.buckets.append({"t": t, "tokens": 0, "steps": 0, "step_s": 0.0, "attn": 0.0,
                                     "running": running, "waiting": waiting})
        self._current = {"t": second, "tokens": 0, "steps": 0, "step_s": 0.0, "attn": 0.0}
        return self._current

    def _close(self, b: dict) -> None:
        running, waiting = self.queue_state()
        b.setdefault("running", running)
        b.setdefault("waiting", waiting)
        self.buckets.append(b)

    def observe(self, stats) -> None:
        now = time.time()
        with self.lock:
            b = self._bucket(now)
            if isinstance(stats, DecodeStats):
                b["steps"] += 1
                b["step_s"] += stats.total_s
                b["attn"] += stats.attn_share
                self.steps.append({"t": round(now, 3), "ms": round(1e3 * stats.total_s, 3),
                                   "attn": round(stats.attn_share, 4), "ctx": stats.n_context,
                                   "batch": stats.batch})
            elif isinstance(stats, PrefillStats):
                self.prefills.append({"t": round(now, 3), "s": round(stats.total_s, 4),
                                      "tokens": stats.n_tokens, "attn": round(stats.attn_share, 4)})
            elif isinstance(stats, StepTokens):
                b["tokens"] += stats.generated_tokens

    def snapshot(self, steps_since: float = 0.0, series_since: float = 0.0) -> dict:
        """Decode/prefill points newer than `steps_since` and closed one-second buckets newer
        than `series_since` (wall times; the page sends back the newest it has of each)."""
        with self.lock:
            self._bucket(time.time())
            series = [{"t": b["t"], "tokens_per_s": b["tokens"],
                       "decode_ms": round(1e3 * b["step_s"] / b["steps"], 3) if b["steps"] else None,
                       "attn_share": round(b["attn"] / b["steps"], 4) if b["steps"] else None,
                       "running": b["running"], "waiting": b["waiting"]}
                      for b in self.buckets if b["t"] > series_since]
            steps = [s for s in self.steps if s["t"] > steps_since]
            prefills = [p for p in self.prefills if p["t"] > steps_since]
        return {"series": series, "steps": steps[-300:], "prefills": prefills}
