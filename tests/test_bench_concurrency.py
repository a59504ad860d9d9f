"""bench/concurrency_bench.py: the interleaved rounds' ratios, and a run end to end on a tiny checkpoint."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.concurrency_bench import median_row, round_ratios  # noqa: E402


def _run(streams: int, aggregate: float, throttled: float = 0.0) -> dict:
    return {"streams": streams, "aggregate": aggregate, "per_stream": aggregate / streams, "ms_per_step": 1.0,
            "mean_batch": float(streams), "wall_s": 1.0, "throttled_s": throttled, "ttft_s": 0.1}


def test_each_ratio_is_taken_within_its_round_then_the_median():
    # the machine doubles its speed between rounds: a ratio across rounds would say 6x or 1.5x
    rounds = [[_run(1, 10.0), _run(4, 30.0)], [_run(1, 20.0), _run(4, 70.0)], [_run(1, 10.0), _run(4, 32.0)]]
    ratios = round_ratios(rounds)
    assert ratios[1] == 1.0
    assert ratios[4] == 3.2          # median of 3.0, 3.5, 3.2


def test_no_one_stream_level_gives_no_ratio():
    assert round_ratios([[_run(4, 30.0)]]) == {}


def test_a_row_is_the_median_of_its_runs_with_throttling_summed():
    row = median_row([_run(4, 30.0, 1.0), _run(4, 50.0, 0.0), _run(4, 40.0, 2.0)])
    assert row["streams"] == 4 and row["aggregate"] == 40.0 and row["throttled_s"] == 3.0


def test_the_bench_runs_interleaved_rounds_through_the_server(tiny_qwen3_dir):
    run = subprocess.run([sys.executable, str(REPO / "bench" / "concurrency_bench.py"), "--model", str(tiny_qwen3_dir),
                          "--weights", "f32", "--streams", "1", "2", "--tokens", "24", "--prompt", "8", "--rounds", "2"],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    out = run.stdout
    assert "median of 2 interleaved rounds" in out
    assert "2 streams vs 1, per round:" in out
    rows = [line.split() for line in out.splitlines() if len(line.split()) == 8 and line.split()[5].endswith("x")]
    assert [r[0] for r in rows] == ["1", "2"] and rows[0][5] == "1.00x"
