"""CPU weights for a benchmark, as systemd's CPUWeight= gives them to units: sibling cpu cgroups.

On a board the appliance runs in a slice of its own with CPUWeight= (the role's appliance.slice,
appliance_cpu_weight), beside system.slice (where a rollout's build runs) and user.slice (ssh
sessions) at 100; the kernel then shares a contended core between the groups by weight, whatever
each does inside. This module puts a
benchmark's engine and its neighbour in two such groups, on cgroup v2 (cpu.weight, systemd's own
scale) or v1 (cpu.shares = weight * 1024 / 100, the conversion systemd uses on the legacy
hierarchy). Needs root and a cpu controller; `available()` says why not otherwise.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _hierarchy() -> tuple[Path, str] | None:
    """(directory to make groups in, "v1" | "v2"), or None without a usable cpu controller."""
    v1 = CGROUP_ROOT / "cpu"
    if (v1 / "cpu.shares").exists():
        return v1, "v1"
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split():
        return CGROUP_ROOT, "v2"
    return None


def available() -> str | None:
    """None when groups can be made here, else why not (one line)."""
    if os.geteuid() != 0:
        return "CPU weights need root (cgroups)"
    if _hierarchy() is None:
        return "no cgroup cpu controller (neither v1 /sys/fs/cgroup/cpu nor v2 with cpu enabled)"
    return None


class CpuGroups:
    """Sibling cgroups named prefix-<name>, each with a systemd-scale weight (1-10000);
    removed on close once their processes have gone."""

    def __init__(self, weights: dict[str, int], prefix: str = "bench"):
        why = available()
        if why:
            raise RuntimeError(why)
        for name, weight in weights.items():      # all checked before any group is made
            if not 1 <= weight <= 10000:
                raise ValueError(f"CPU weight {weight} for {name}: systemd's range is 1-10000")
        base, self.version = _hierarchy()
        if self.version == "v2":
            # v2's rule: a group with processes has no child groups; the root is exempt.
            subtree = base / "cgroup.subtree_control"
            if "cpu" not in subtree.read_text().split():
                subtree.write_text("+cpu")
        self.dirs: dict[str, Path] = {}
        for name, weight in weights.items():
            path = base / f"{prefix}-{os.getpid()}-{name}"
            path.mkdir(exist_ok=True)
            if self.version == "v2":
                (path / "cpu.weight").write_text(str(weight))
            else:
                (path / "cpu.shares").write_text(str(max(2, weight * 1024 // 100)))
            self.dirs[name] = path

    def joiner(self, name: str):
        """A preexec_fn for subprocess.Popen: the child joins group `name` before it runs, so
        every thread it starts is in it."""
        procs = str(self.dirs[name] / "cgroup.procs")

        def join() -> None:
            with open(procs, "w") as f:
                f.write(str(os.getpid()))
        return join

    def close(self) -> None:
        for path in self.dirs.values():
            for _ in range(50):                  # the killed neighbour's exit is asynchronous
                try:
                    path.rmdir()
                    break
                except OSError:
                    time.sleep(0.1)
        self.dirs = {}

    def __enter__(self) -> "CpuGroups":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
