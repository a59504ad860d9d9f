"""How long this process's threads waited for a CPU: the sign of a neighbour on its cores.

Decode runs one team of threads over the big cores, and a step is as slow as its slowest
thread: when another process (a build, a checksum, a busy shell) takes one of those cores,
our threads are ready to run and wait in the kernel's run queue. The kernel counts that wait
per thread in /proc/<pid>/task/<tid>/schedstat (run ns, run-queue wait ns, time slices;
CONFIG_SCHED_INFO, on in Debian's and Rockchip's kernels). Summed over the threads, against
the CPU time they ran, it tells an operator whether a slow board is slow because it shares
its CPU (docs/fleet.md, BoardCpuContended), which neither the step times nor the load
average say.

Threads come and go (the HTTP threads, a job's helper): the totals keep what a thread had
at its last read after it exits, so they never go back, as a Prometheus counter must.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from pathlib import Path

NS = 1e-9


@dataclass(frozen=True)
class CpuTimes:
    run_s: float       # time the threads ran on a CPU
    wait_s: float      # time they were ready to run and waited for one


class CpuWait:
    """Totals over a process's threads, past and present (`proc`: /proc/self, or another pid's)."""

    def __init__(self, proc: str | os.PathLike = "/proc/self"):
        self.task_dir = Path(proc) / "task"
        self._lock = threading.Lock()
        self._last: dict[int, tuple[int, int]] = {}   # tid -> (run ns, wait ns) at the last read
        self._ended = (0, 0)                           # what threads gone since had at their last read

    def read(self) -> CpuTimes | None:
        """The totals now; None where the kernel keeps no schedstat (or there is no /proc)."""
        with self._lock:
            now = self._threads()
            if not now:
                return None
            ended_run, ended_wait = self._ended
            for tid, (run, wait) in self._last.items():
                current = now.get(tid)
                # gone, or its id taken by a new thread (which starts again from zero)
                if current is None or current[0] < run or current[1] < wait:
                    ended_run += run
                    ended_wait += wait
            self._ended = (ended_run, ended_wait)
            self._last = now
            return CpuTimes(run_s=(ended_run + sum(r for r, _ in now.values())) * NS,
                            wait_s=(ended_wait + sum(w for _, w in now.values())) * NS)

    def _threads(self) -> dict[int, tuple[int, int]]:
        try:
            names = os.listdir(self.task_dir)
        except OSError:
            return {}
        found = {}
        for name in names:
            try:
                fields = (self.task_dir / name / "schedstat").read_text().split()
                found[int(name)] = (int(fields[0]), int(fields[1]))
            except (OSError, ValueError, IndexError):
                continue          # the thread ended between the listing and the read
        return found
