"""Short in-memory history for the dashboard (Prometheus keeps the long one).

Fed by the same stats objects as appliance.metrics: decode steps become points
(time, ms/token, attention share, context, batch); tokens, queue depth and speculative
decoding's drafted and accepted tokens are summed into one-second buckets, and the drafts'
acceptance is also kept per draft position since the start. Each bucket also carries the cores
the process ran on and the cores' worth of time its threads waited for a CPU
(appliance/telemetry/cpu_wait.py), read when the bucket closes: a neighbour on the cores shows
there on the board itself, as BoardCpuContended shows it in Prometheus. Everything is
bounded: a board serves for months.
"""
from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from appliance.engine.speculative import SpeculativeStats
from appliance.engine.stats import DecodeStats, PrefillStats
from appliance.server.scheduler import StepTokens
from appliance.telemetry.cpu_wait import CpuTimes


class LiveStats:
    def __init__(self, seconds: int = 300, points: int = 600,
                 queue_state: Callable[[], tuple[int, int]] | None = None,
                 cpu_times: Callable[[], CpuTimes | None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.lock = threading.Lock()
        self.cpu_times, self.clock = cpu_times, clock
        self._cpu_last: tuple[float, CpuTimes] | None = None   # (clock, totals) at the last reading
        self.steps: collections.deque[dict] = collections.deque(maxlen=points)
        self.prefills: collections.deque[dict] = collections.deque(maxlen=points // 4)
        self.buckets: collections.deque[dict] = collections.deque(maxlen=seconds)
        self.queue_state = queue_state or (lambda: (0, 0))
        self._current: dict | None = None
        # speculative decoding since the start: drafts that reached position i + 1, and accepted there
        self.spec_drafted: list[int] = []
        self.spec_accepted: list[int] = []

    def _bucket(self, now: float) -> dict:
        """The bucket for the current second, closing (and zero-filling) past ones."""
        second = int(now)
        cur = self._current
        if cur is not None and cur["t"] == second:
            return cur
        if cur is not None:
            cpu = self._cpu_rates()
            self._close({**cur, **cpu})
            gap_start = cur["t"] + 1
            if second - gap_start > self.buckets.maxlen:
                gap_start = second - self.buckets.maxlen
            running, waiting = self.queue_state()
            # idle seconds still show on the chart, with the CPU rates of the whole span they
            # belong to (nothing read the totals in between)
            for t in range(gap_start, second):
                self.buckets.append({**self._empty(t), "running": running, "waiting": waiting, **cpu})
        if self._cpu_last is None:
            self._cpu_rates()          # the first bucket's baseline: its own CPU time, not the process's since start
        self._current = self._empty(second)
        return self._current

    def _cpu_rates(self) -> dict:
        """Cores run and cores' worth of waiting since the last reading (None: unknown here, or no
        earlier reading to count from). Read as a bucket closes, and as the first one opens."""
        times = self.cpu_times() if self.cpu_times is not None else None
        if times is None:
            return {"cpu_run": None, "cpu_wait": None}
        now, last = self.clock(), self._cpu_last
        self._cpu_last = (now, times)
        if last is None or now <= last[0]:
            return {"cpu_run": None, "cpu_wait": None}
        span = now - last[0]
        return {"cpu_run": (times.run_s - last[1].run_s) / span, "cpu_wait": (times.wait_s - last[1].wait_s) / span}

    @staticmethod
    def _empty(second: int) -> dict:
        return {"t": second, "tokens": 0, "steps": 0, "step_s": 0.0, "attn": 0.0, "drafted": 0, "accepted": 0}

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
            elif isinstance(stats, SpeculativeStats):
                b["drafted"] += stats.draft_tokens
                b["accepted"] += stats.accepted_tokens
                grow = len(stats.drafted) - len(self.spec_drafted)
                if grow > 0:
                    self.spec_drafted += [0] * grow
                    self.spec_accepted += [0] * grow
                for i, (drafted, accepted) in enumerate(zip(stats.drafted, stats.accepted)):
                    self.spec_drafted[i] += drafted
                    self.spec_accepted[i] += accepted

    def speculation(self) -> dict:
        """Drafted and accepted tokens since the start, and per draft position."""
        with self.lock:
            drafted, accepted = list(self.spec_drafted), list(self.spec_accepted)
        return {"draft_tokens": sum(drafted), "accepted_tokens": sum(accepted),
                "by_position": [{"position": i + 1, "drafted": d, "accepted": a}
                                for i, (d, a) in enumerate(zip(drafted, accepted))]}

    def snapshot(self, steps_since: float = 0.0, series_since: float = 0.0) -> dict:
        """Decode/prefill points newer than `steps_since` and closed one-second buckets newer
        than `series_since` (wall times; the page sends back the newest it has of each)."""
        with self.lock:
            self._bucket(time.time())
            series = [{"t": b["t"], "tokens_per_s": b["tokens"],
                       "decode_ms": round(1e3 * b["step_s"] / b["steps"], 3) if b["steps"] else None,
                       "attn_share": round(b["attn"] / b["steps"], 4) if b["steps"] else None,
                       "running": b["running"], "waiting": b["waiting"],
                       "spec_drafted": b["drafted"], "spec_accepted": b["accepted"],
                       "cpu_run_cores": _rounded(b.get("cpu_run")), "cpu_wait_cores": _rounded(b.get("cpu_wait"))}
                      for b in self.buckets if b["t"] > series_since]
            steps = [s for s in self.steps if s["t"] > steps_since]
            prefills = [p for p in self.prefills if p["t"] > steps_since]
        return {"series": series, "steps": steps[-300:], "prefills": prefills,
                "speculation": self.speculation()}     # after the lock: speculation() takes it


def _rounded(v: float | None) -> float | None:
    return None if v is None else round(v, 3)
