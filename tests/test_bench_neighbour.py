"""bench/neighbour_bench.py runs end to end on a tiny checkpoint and prints both phases."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a second CPU for the busy loop")
def test_the_neighbour_bench_prints_both_phases(tmp_path):
    cpu = sorted(os.sched_getaffinity(0))[-1]
    run = subprocess.run([sys.executable, str(REPO / "bench" / "neighbour_bench.py"), "--workdir", str(tmp_path),
                          "--shape", "tiny", "--context", "40", "--rounds", "1", "--steps", "2",
                          "--hog-cpu", str(cpu)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    lines = run.stdout.splitlines()
    assert any(line.strip().startswith("quiet |") for line in lines)
    assert any(line.strip().startswith("neighbour |") for line in lines)
    assert "decode beside the loop / quiet:" in lines[-1]
    loops = [p for p in psutil.process_iter(["cmdline"])
             if (p.info["cmdline"] or [""])[-1].endswith("while True:\n    pass\n")]
    assert not loops, "the busy loop outlived the run"


def test_the_neighbour_bench_rejects_a_cpu_it_may_not_use(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "bench" / "neighbour_bench.py"), "--workdir", str(tmp_path),
                          "--hog-cpu", "4096"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--hog-cpu 4096" in run.stderr
