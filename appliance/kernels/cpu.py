"""Which cores to run on: the big cluster of a big.LITTLE CPU, found from cpufreq.

On RK3588 the four Cortex-A76 report a higher cpuinfo_max_freq (2.256-2.4 GHz)
than the four A55 (1.8 GHz); running the kernels' threads on the A55 too only
makes every parallel region wait for the slowest core. Elsewhere (no cpufreq, or
all cores equal) every core we may run on counts.
"""
from __future__ import annotations

import os
from pathlib import Path


def sysfs_root() -> Path:
    return Path(os.environ.get("APPLIANCE_SYSFS_ROOT", "/sys"))


def allowed_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def max_frequencies(root: Path | None = None) -> dict[int, int]:
    """cpu index -> cpuinfo_max_freq (kHz) for the CPUs that report one."""
    base = (root or sysfs_root()) / "devices/system/cpu"
    freqs = {}
    for path in base.glob("cpu[0-9]*/cpufreq/cpuinfo_max_freq"):
        try:
            freqs[int(path.parent.parent.name[3:])] = int(path.read_text().strip())
        except (OSError, ValueError):
            continue
    return freqs


def big_cores(root: Path | None = None) -> list[int]:
    """The allowed CPUs with the highest maximum frequency (all allowed CPUs if unknown)."""
    allowed = allowed_cpus()
    freqs = {cpu: f for cpu, f in max_frequencies(root).items() if cpu in allowed}
    if not freqs or len(freqs) < len(allowed) and set(freqs) != set(allowed):
        return allowed
    top = max(freqs.values())
    return sorted(cpu for cpu, f in freqs.items() if f == top)


def default_threads() -> int:
    return len(big_cores())


def pin_to(cpus: list[int]) -> bool:
    """Pin this process to `cpus`; False where the OS refuses (then we run unpinned)."""
    try:
        os.sched_setaffinity(0, cpus)
        return True
    except (AttributeError, OSError, ValueError):
        return False
