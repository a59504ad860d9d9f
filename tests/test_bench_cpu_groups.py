"""bench/cpu_groups.py: sibling cpu cgroups with systemd's CPUWeight= scale, as the role's slice gets."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench import cpu_groups  # noqa: E402
from bench.cpu_groups import CpuGroups  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_groups.available() is not None,
                                reason=str(cpu_groups.available()))

BUSY = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime + stime


def test_groups_carry_the_weights_and_are_removed_after():
    with CpuGroups({"engine": 1000, "neighbour": 10}, prefix="test") as groups:
        dirs = dict(groups.dirs)
        if groups.version == "v1":
            assert (dirs["engine"] / "cpu.shares").read_text().strip() == "10240"
            assert (dirs["neighbour"] / "cpu.shares").read_text().strip() == "102"
        else:
            assert (dirs["engine"] / "cpu.weight").read_text().strip() == "1000"
        proc = subprocess.Popen(["sleep", "5"], preexec_fn=groups.joiner("engine"))
        try:
            own = Path(f"/proc/{proc.pid}/cgroup").read_text()
            assert dirs["engine"].name in own
        finally:
            proc.kill()
            proc.wait()
    assert not any(d.exists() for d in dirs.values())


def test_a_weight_out_of_systemds_range_is_refused():
    with pytest.raises(ValueError, match="1-10000"):
        CpuGroups({"engine": 0}, prefix="test")
    with pytest.raises(ValueError, match="1-10000"):                 # and no group is left behind
        CpuGroups({"engine": 1000, "neighbour": 10001}, prefix="test")
    assert not list(cpu_groups._hierarchy()[0].glob(f"test-{os.getpid()}-*"))


def test_the_kernel_gives_a_shared_core_by_weight():
    """Two busy loops on one CPU, in groups of 1000 and 100: the first gets most of it."""
    cpu = max(os.sched_getaffinity(0))
    with CpuGroups({"heavy": 1000, "light": 100}, prefix="test") as groups:
        procs = [subprocess.Popen([sys.executable, "-c", BUSY, str(cpu)], preexec_fn=groups.joiner(name))
                 for name in ("heavy", "light")]
        try:
            time.sleep(0.3)                         # both started and pinned
            before = [_cpu_seconds(p.pid) for p in procs]
            time.sleep(1.0)
            heavy, light = (_cpu_seconds(p.pid) - b for p, b in zip(procs, before))
        finally:
            for p in procs:
                p.kill()
                p.wait()
    assert heavy > 3 * light, (heavy, light)        # 10:1 by weight; other load takes from both
