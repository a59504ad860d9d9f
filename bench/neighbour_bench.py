"""Decode beside a busy neighbour, the neighbour switched on and off inside one run.

    .venv/bin/python bench/neighbour_bench.py [--context 4096] [--rounds 6] [--steps 16] [--hog-cpu 1]
                                              [--hog-session same|own] [--threads 2]
    .venv/bin/python bench/neighbour_bench.py --shape tiny --context 64 --rounds 1 --steps 2   # checks the script

One engine process on the random Qwen3-0.6B-shaped checkpoint (bench/checkpoint.py) prefills
`context` tokens once, then decodes `rounds` x (`steps` quiet, `steps` beside a busy loop pinned to
`--hog-cpu`). Alternating inside one process compares the two phases on the same memory, the same
cache and the same minute of a VM whose speed drifts between runs. Per phase: median ms per step,
of it attention and GEMMs (the engine's step timer), the ratio neighbour / quiet (the kernels issue's
target at context 128: at most 1.5x), and the kernels' pool counters per step (chunks the caller
took back from a stalled worker, times it slept).

--hog-session same puts the loop in this process's session (one scheduling group: the server's own
threads, or another process of the same service); own gives it a session of its own, as a build
over ssh has, where the kernel shares the CPU between sessions first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.checkpoint import SHAPES, shape_dir  # noqa: E402
from bench.compare_llamacpp import log, start_hog, stop_hog  # noqa: E402

TARGET = 1.5


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/appliance-bench"))
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per phase")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hog-cpu", type=int, default=1)
    ap.add_argument("--hog-session", choices=("same", "own"), default="same")
    ap.add_argument("--kv", default="q8")
    args = ap.parse_args(argv)
    args.hog_cmd = ""   # start_hog's other neighbour: this benchmark runs the busy loop only
    if args.context < 1 or args.rounds < 1 or args.steps < 1:
        ap.error("--context, --rounds and --steps must be positive")
    if args.hog_cpu not in os.sched_getaffinity(0):
        ap.error(f"--hog-cpu {args.hog_cpu}: not a CPU this process may use ({sorted(os.sched_getaffinity(0))})")

    from appliance import Engine
    from appliance.cli.bench import _prompt
    from appliance.engine.sampling import SamplingParams
    from appliance.engine.stats import DecodeStats
    from appliance.kernels.dispatch import kernels as K
    from bench.checkpoint import build_checkpoint

    model_dir = shape_dir(args.workdir, args.shape)
    build_checkpoint(model_dir, shape=SHAPES[args.shape], cache_dir=args.workdir, log=log)
    gen = args.rounds * 2 * args.steps + 4
    engine = Engine.load(str(model_dir), weights="q8", kv=args.kv, threads=args.threads,
                         max_context=args.context + gen + 32, progress=False)
    seen: list = []
    engine.add_stats_listener(seen.append)
    seq = engine.start(_prompt(engine, args.context, 5), SamplingParams(max_tokens=gen, temperature=0.0,
                                                                       ignore_eos=True))
    load0 = os.getloadavg()[0]
    steps = {"quiet": [], "neighbour": []}
    counters = {"quiet": {}, "neighbour": {}}
    try:
        log(f"prefill {args.context} tokens")
        engine.prefill(seq)
        for _ in range(4):   # warm-up
            engine.decode([seq])
        for _ in range(args.rounds):
            for phase in ("quiet", "neighbour"):
                loop = start_hog(args) if phase == "neighbour" else None
                try:
                    if loop is not None:
                        time.sleep(0.3)   # the loop is running
                    seen.clear()
                    before = K.pool_stats()
                    for _ in range(args.steps):
                        engine.decode([seq])
                    after = K.pool_stats()
                finally:
                    stop_hog(loop)
                steps[phase] += [s for s in seen if isinstance(s, DecodeStats)]
                for name in after:
                    counters[phase][name] = counters[phase].get(name, 0) + after[name] - before[name]
    finally:
        engine.release(seq)

    print(f"decode at context {args.context}, {args.threads} threads, kernel path {K.kernel_path()}; "
          f"busy loop on CPU {args.hog_cpu} ({args.hog_session} session) in {args.rounds} rounds of "
          f"{args.steps} steps; load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after")
    print(f"{'phase':>9} | {'ms/step':>7} | {'attention':>9} | {'GEMMs':>6} | {'vs quiet':>8} | "
          f"{'taken back':>10} | {'caller sleeps':>13} | {'worker chunks':>13}")
    quiet_ms = None
    for phase, rows in steps.items():
        med = [1e3 * statistics.median(getattr(s, f) for s in rows) for f in ("total_s", "attn_s", "gemm_s")]
        quiet_ms = med[0] if phase == "quiet" else quiet_ms
        n = len(rows)
        c = counters[phase]
        share = c["worker_chunks"] / max(1, c["worker_chunks"] + c["caller_chunks"])
        print(f"{phase:>9} | {med[0]:7.1f} | {med[1]:9.1f} | {med[2]:6.1f} | {med[0] / quiet_ms:7.2f}x | "
              f"{c['taken_back'] / n:10.1f} | {c['caller_sleeps'] / n:13.1f} | {share:12.0%}")
    ratio = statistics.median(s.total_s for s in steps["neighbour"]) * 1e3 / quiet_ms
    verdict = "met" if ratio <= TARGET else "MISSED"
    print(f"decode beside the loop / quiet: {ratio:.2f}x (target at context 128: <= {TARGET}x; {verdict} here)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
