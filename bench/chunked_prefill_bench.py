"""Running streams while a long prompt arrives: their inter-token latency and the prompt's TTFT.

Through the real server (`appliance serve`, the prefix cache off so that every prompt is
computed): 2 streams decode; once they flow, a 4096-token prompt arrives. Per step budget
(`--max-step-tokens`) it prints the streams' gaps between tokens while that prompt is
prefilled (median, p99, max), their gap before it came, the prompt's time to first token,
and the same prompt's TTFT alone on the idle server. `whole` is a budget of the whole prompt
in one step: the behaviour before chunked prefill (the streams wait for all of it).

Targets: the streams' max gap below a quarter of the prompt's solo prefill time, and its
TTFT within 1.25x of the solo one.

    python bench/chunked_prefill_bench.py                      # Qwen3-0.6B-shaped random checkpoint
    python bench/chunked_prefill_bench.py --budgets whole,auto,64,128 --long 4096 --threads 2
    python bench/chunked_prefill_bench.py --model DIR --long 300 --budgets whole,auto   # a tiny check

Not a test: it takes minutes and its numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.concurrency_bench import bench_checkpoint  # noqa: E402
from bench.live_server import Server, load_line, percentile, stream  # noqa: E402


def token_prompt(n: int, vocab: int, salt: int) -> list[int]:
    return [(101 + 37 * salt + 13 * j + (j * j) % 7) % (vocab - 300) + 100 for j in range(n)]


def ttft(server: Server, prompt: list[int]) -> float:
    times: list[float] = []
    t0 = time.perf_counter()
    stream(server.base, "/v1/completions", {"model": server.model, "prompt": prompt, "max_tokens": 1,
                                            "temperature": 0}, times)
    return times[0] - t0


def run_budget(model_dir: Path, budget: str, args) -> dict:
    flags = ["--disable-prefix-cache", "--max-batch", str(args.streams + 1),
             "--max-context", str(args.long + args.stream_tokens + 64)]
    if budget != "auto":
        flags += ["--max-step-tokens", str(args.long + args.streams if budget == "whole" else int(budget))]
    with Server(model_dir, *flags, threads=args.threads, log_level="warning") as server:
        vocab = int(server.facts["vocab"])
        ttft(server, token_prompt(64, vocab, 99))                           # warm
        solo = ttft(server, token_prompt(args.long, vocab, 1))
        stop = threading.Event()
        times = [[] for _ in range(args.streams)]
        threads = [threading.Thread(target=stream, daemon=True, args=(
            server.base, "/v1/completions", {"model": server.model, "prompt": token_prompt(32, vocab, 10 + i),
                                             "max_tokens": args.stream_tokens, "ignore_eos": True,
                                             "temperature": 0}, times[i], stop.is_set))
            for i in range(args.streams)]
        for t in threads:
            t.start()
        while min(len(ts) for ts in times) < 8:                           # the streams flow
            time.sleep(0.05)
        t_arrive = time.perf_counter()
        long_ttft = ttft(server, token_prompt(args.long, vocab, 2))
        t_first = t_arrive + long_ttft
        time.sleep(1.0)
        stop.set()
        before, during = [], []
        for ts in times:
            for a, b in zip(ts, ts[1:]):
                (during if b > t_arrive and a < t_first else before if b <= t_arrive else []).append(b - a)
        budget_now = server.health()["queue"].get("step_tokens")
    return {"budget": budget, "in_force": budget_now, "solo": solo, "ttft": long_ttft,
            "before_ms": 1e3 * statistics.median(before) if before else float("nan"),
            "median_ms": 1e3 * statistics.median(during) if during else float("nan"),
            "p99_ms": 1e3 * percentile(during, 0.99), "max_ms": 1e3 * max(during, default=float("nan")),
            "gaps": len(during)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the Qwen3-0.6B-shaped random checkpoint)")
    ap.add_argument("--long", type=int, default=4096, help="tokens of the prompt that arrives")
    ap.add_argument("--streams", type=int, default=2, help="streams decoding when it arrives")
    ap.add_argument("--stream-tokens", type=int, default=2048, help="max tokens of each stream (they are cut "
                                                                     "once the long prompt's first token is out)")
    ap.add_argument("--budgets", default="whole,auto", help="comma-separated: whole, auto or a row count")
    ap.add_argument("--threads", type=int, help="engine threads (default: the engine's choice)")
    args = ap.parse_args(argv)
    model_dir = Path(args.model) if args.model else bench_checkpoint()
    print(f"{args.streams} streams decoding, then a {args.long}-token prompt; prefix cache off; {load_line()}")
    rows = [run_budget(model_dir, b, args) for b in args.budgets.split(",")]
    print()
    print(f"{'budget':>7} {'rows':>5} {'gap before':>10} {'gap median':>10} {'gap p99':>9} {'gap max':>9} "
          f"{'TTFT s':>7} {'solo s':>7} {'TTFT/solo':>9} {'max/solo':>8}")
    for r in rows:
        print(f"{r['budget']:>7} {r['in_force']!s:>5} {r['before_ms']:>8.1f}ms {r['median_ms']:>8.1f}ms "
              f"{r['p99_ms']:>7.1f}ms {r['max_ms']:>7.1f}ms {r['ttft']:>7.2f} {r['solo']:>7.2f} "
              f"{r['ttft'] / r['solo']:>8.2f}x {r['max_ms'] / 1e3 / r['solo']:>8.2f}")
    print()
    for r in rows:
        if r["budget"] != "whole":
            gap_ok = r["max_ms"] / 1e3 < r["solo"] / 4
            ttft_ok = r["ttft"] <= 1.25 * r["solo"]
            print(f"budget {r['budget']}: max gap {'<' if gap_ok else '>='} a quarter of the solo prefill "
                  f"({'met' if gap_ok else 'MISSED'}); TTFT {r['ttft'] / r['solo']:.2f}x solo (target <= 1.25x: "
                  f"{'met' if ttft_ok else 'MISSED'})")
    print(load_line() + " at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
