"""appliance/telemetry/cpu_wait.py: the run-queue wait of a process's threads, as a counter."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from appliance.telemetry.cpu_wait import CpuWait


def write_thread(proc: Path, tid: int, run_ns: int, wait_ns: int) -> None:
    (proc / "task" / str(tid)).mkdir(parents=True, exist_ok=True)
    (proc / "task" / str(tid) / "schedstat").write_text(f"{run_ns} {wait_ns} 7\n")


def remove_thread(proc: Path, tid: int) -> None:
    (proc / "task" / str(tid) / "schedstat").unlink()
    (proc / "task" / str(tid)).rmdir()


def test_sums_the_threads_and_keeps_what_ended_threads_had(tmp_path):
    write_thread(tmp_path, 100, 2_000_000_000, 500_000_000)
    write_thread(tmp_path, 101, 1_000_000_000, 250_000_000)
    reader = CpuWait(tmp_path)
    first = reader.read()
    assert (first.run_s, first.wait_s) == pytest.approx((3.0, 0.75))
    # 101 ends; 102 starts; 100 runs on
    remove_thread(tmp_path, 101)
    write_thread(tmp_path, 102, 100_000_000, 50_000_000)
    write_thread(tmp_path, 100, 2_500_000_000, 600_000_000)
    second = reader.read()
    assert (second.run_s, second.wait_s) == pytest.approx((3.6, 0.9))
    # 100's id is taken by a new thread, which starts from zero: 100's last counts stay
    write_thread(tmp_path, 100, 10_000_000, 0)
    third = reader.read()
    assert (third.run_s, third.wait_s) == pytest.approx((2.5 + 1.0 + 0.1 + 0.01, 0.6 + 0.25 + 0.05))
    assert third.run_s >= second.run_s and third.wait_s >= second.wait_s


def test_no_schedstat_gives_nothing(tmp_path):
    assert CpuWait(tmp_path / "missing").read() is None
    (tmp_path / "task" / "5").mkdir(parents=True)         # a kernel without CONFIG_SCHED_INFO
    assert CpuWait(tmp_path).read() is None


# Two threads in one process, pinned to one CPU, each hashing (hashlib lets the GIL go for
# large buffers): each is ready to run while the other has the CPU.
TWO_ON_ONE_CPU = """
import hashlib, os, sys, threading
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
data = bytes(1 << 24)
def spin():
    while True:
        hashlib.sha256(data).digest()
for _ in range(2):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.mark.skipif(not Path("/proc/self/schedstat").exists(), reason="the kernel keeps no schedstat")
def test_two_threads_sharing_one_cpu_wait_about_as_long_as_they_run():
    child = subprocess.Popen([sys.executable, "-c", TWO_ON_ONE_CPU], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        reader = CpuWait(f"/proc/{child.pid}")
        before = reader.read()
        time.sleep(1.5)
        after = reader.read()
    finally:
        child.kill()
        child.wait()
    ran, waited = after.run_s - before.run_s, after.wait_s - before.wait_s
    assert ran > 0.3, f"the child ran only {ran:.2f} s"
    # alone on the CPU the two would each wait ~as long as they run; other load only adds to it
    assert waited > 0.5 * ran, (ran, waited)


def test_this_process_has_its_own_totals():
    if not Path(f"/proc/{os.getpid()}/task").exists():
        pytest.skip("no /proc")
    times = CpuWait().read()
    assert times is not None and times.run_s > 0 and times.wait_s >= 0
