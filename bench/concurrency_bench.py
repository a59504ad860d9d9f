"""Aggregate decode tokens/s against concurrent streams, through the real server.

Starts `python -m appliance serve` (gunicorn, one worker) on a free loopback port,
then for 1, 2, 4 and 8 concurrent streams sends the same-length prompt (token ids,
so no tokenizer luck) with ignore_eos and counts the tokens every stream received
while all of them were decoding at once. Continuous batching should make the
aggregate grow with the streams: one batched GEMM per step serves them all.
Prints a table, and whether the CPU throttled while it ran (from /metrics).

    python bench/concurrency_bench.py                         # Qwen3-0.6B-shaped random checkpoint
    python bench/concurrency_bench.py --model DIR --tokens 64 --streams 1 2 4 8
    python bench/concurrency_bench.py --engine-only      # the engine's decode step alone, no HTTP
    python bench/concurrency_bench.py --streams 1 4 8 --rounds 3   # interleaved rounds, median ratios

Not a test: it takes minutes and its numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.live_server import Server  # noqa: E402
DEFAULT_CACHE = Path(os.environ.get("APPLIANCE_BENCH_DIR", Path.home() / ".cache" / "appliance" / "bench"))


def bench_checkpoint() -> Path:
    """The Qwen3-0.6B-shaped random checkpoint (built once, then reused)."""
    sys.path.insert(0, str(REPO))
    from bench.checkpoint import build_checkpoint

    return build_checkpoint(DEFAULT_CACHE / "qwen3-0.6b-random")


def scrape(base: str) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(requests.get(base + "/metrics", timeout=30).text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(m: dict, name: str) -> float:
    return sum(v for (n, _), v in m.items() if n == name)


def stream_once(base: str, model: str, prompt_ids: list[int], max_tokens: int, out: list) -> None:
    """One streaming completion; appends (arrival times of each token) to out."""
    times = []
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with requests.post(base + "/v1/completions", json=body, stream=True, timeout=(10, 900)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(chunk["error"]["message"])
            if chunk["choices"] and chunk["choices"][0]["finish_reason"] is None:
                times.append(time.perf_counter())
            elif chunk["choices"]:
                times.append(time.perf_counter())       # the last token comes with its finish
    out.append(times)


def run_level(base: str, model: str, n: int, prompt_len: int, max_tokens: int, vocab: int) -> dict:
    results: list[list[float]] = []
    threads = [threading.Thread(target=stream_once, args=(
        base, model, [(17 + 31 * i + 7 * j) % vocab for j in range(prompt_len)], max_tokens, results))
        for i in range(n)]
    before = scrape(base)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(1800)
    wall = time.perf_counter() - t0
    after = scrape(base)
    if len(results) != n:
        raise RuntimeError(f"{n - len(results)} of {n} streams failed")
    # the window in which every stream was decoding: after the last first token, before the first end
    start = max(ts[0] for ts in results)
    end = min(ts[-1] for ts in results)
    if end - start > 0.5:
        tokens = sum(sum(1 for t in ts if start < t <= end) for ts in results)
        aggregate = tokens / (end - start)
    else:   # too short to overlap: fall back to everything after each first token
        tokens = sum(len(ts) - 1 for ts in results)
        aggregate = tokens / (max(ts[-1] for ts in results) - min(ts[0] for ts in results))
    steps = total(after, "appliance_decode_batch_size_count") - total(before, "appliance_decode_batch_size_count")
    batched = total(after, "appliance_decode_batch_size_sum") - total(before, "appliance_decode_batch_size_sum")
    step_s = (total(after, "appliance_decode_token_seconds_sum") - total(before, "appliance_decode_token_seconds_sum"))
    throttled_s = (total(after, "appliance_cpu_throttled_seconds_total")
                   - total(before, "appliance_cpu_throttled_seconds_total"))
    preempted = total(after, "appliance_kv_preemptions_total") - total(before, "appliance_kv_preemptions_total")
    if preempted:
        print(f"warning: {preempted:.0f} streams were paused by a full KV pool at {n} streams", file=sys.stderr)
    return {"streams": n, "aggregate": aggregate, "per_stream": aggregate / n,
            "ms_per_step": 1e3 * step_s / batched if batched else float("nan"),   # observed once per token
            "mean_batch": batched / steps if steps else float("nan"), "wall_s": wall,
            "throttled_s": throttled_s,
            "ttft_s": sum(ts[0] for ts in results) / n - t0}


def round_ratios(rounds: list[list[dict]]) -> dict[int, float]:
    """Each stream count's aggregate against its own round's one stream, median over rounds
    ({} without a one-stream level). A ratio of two runs minutes apart measures the machine's drift
    as much as the batching; interleaved rounds keep each ratio's two runs adjacent."""
    out = {}
    for i, r in enumerate(rounds[0]):
        per = [rnd[i]["aggregate"] / one["aggregate"] for rnd in rounds
               for one in rnd if one["streams"] == 1]
        if per:
            out[r["streams"]] = statistics.median(per)
    return out


def median_row(runs: list[dict]) -> dict:
    """One stream count's runs as one row: the median of every number (throttling summed)."""
    row = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k != "throttled_s"}
    row["streams"] = runs[0]["streams"]
    row["throttled_s"] = sum(r["throttled_s"] for r in runs)
    return row


def engine_only(model_dir: Path, streams: list[int], prompt_len: int, steps: int, threads, weights) -> int:
    """Decode steps of the engine alone, in process: what batching buys before any HTTP."""
    sys.path.insert(0, str(REPO))
    from appliance import Engine
    from appliance.engine.sampling import SamplingParams

    engine = Engine.load(model_dir, weights=weights, threads=threads, max_context=prompt_len + steps + 64,
                         kv_cache_tokens=max(streams) * (prompt_len + steps + 64), progress=False)
    vocab = engine.info()["vocab"]
    print(f"engine only: {engine.model_name}, kernels {engine.info()['kernel_path']}, threads {engine.threads}")
    print(f"{'batch':>5} {'ms/step':>8} {'tok/s':>8} {'vs 1':>6} {'attn share':>10} {'gemm ms':>8} {'attn ms':>8} "
          f"{'rest ms':>8}")
    base, stats = None, []
    engine.add_stats_listener(lambda st: stats.append(st) if hasattr(st, "batch") else None)
    for b in streams:
        seqs = [engine.start([(17 + 31 * i + 7 * j) % vocab for j in range(prompt_len)],
                             SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True))
                for i in range(b)]
        for s in seqs:
            engine.prefill(s)
        engine.decode(seqs)                      # warm
        stats.clear()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.decode(seqs)
        dt = (time.perf_counter() - t0) / steps
        for s in seqs:
            engine.release(s)
        attn = sum(s.attn_s for s in stats) / max(1e-9, sum(s.total_s for s in stats))
        # the step's parts, median over the timed steps (a shared machine's outliers stay out)
        gemm_ms, attn_ms, rest_ms = (1e3 * statistics.median(getattr(s, f) for s in stats) if stats else float("nan")
                                     for f in ("gemm_s", "attn_s", "rest_s"))
        base = base or b / dt
        print(f"{b:>5} {1e3 * dt:>8.1f} {b / dt:>8.2f} {b / dt / base:>5.2f}x {attn:>10.2f} {gemm_ms:>8.1f} "
              f"{attn_ms:>8.1f} {rest_ms:>8.1f}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the Qwen3-0.6B-shaped random checkpoint)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per stream")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per stream")
    ap.add_argument("--threads", type=int, help="engine threads (default: the engine's choice)")
    ap.add_argument("--weights", default="q8")
    ap.add_argument("--engine-only", action="store_true", help="time the engine's decode steps alone")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every stream count this many times, interleaved; ratios from each round's "
                         "own one-stream run, then their median (a shared machine's speed drifts in minutes)")
    args = ap.parse_args(argv)

    model_dir = Path(args.model) if args.model else bench_checkpoint()
    if args.engine_only:
        return engine_only(model_dir, args.streams, args.prompt, min(args.tokens, 16), args.threads, args.weights)
    flags = ["--max-batch", str(max(args.streams)), "--max-queue", str(max(args.streams)),
             "--max-context", str(max(512, args.prompt + args.tokens + 16)), "--weights", args.weights,
             # a KV pool for every stream at once, so the pool never limits the batch
             "--kv-cache-tokens", str(max(args.streams) * max(512, args.prompt + args.tokens + 16))]
    with Server(model_dir, *flags, threads=args.threads, log_level="warning") as server:
        base = server.base
        facts = server.facts
        model = facts["id"]
        print(f"model {model}: {facts.get('layers')} layers, hidden {facts.get('hidden')}, vocab {facts.get('vocab')}, "
              f"weights {facts.get('weights')}, kv {facts.get('kv')}, kernels {facts.get('kernel_path')}, "
              f"threads {facts.get('threads')}")
        print(f"prompt {args.prompt} tokens, {args.tokens} generated per stream, greedy, ignore_eos; "
              f"load average at start {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        run_level(base, model, 1, args.prompt, 4, facts["vocab"])          # warm up
        rounds = [[run_level(base, model, n, args.prompt, args.tokens, facts["vocab"]) for n in args.streams]
                  for _ in range(max(1, args.rounds))]
        ratios = round_ratios(rounds)
        rows = [median_row([rnd[i] for rnd in rounds]) for i in range(len(args.streams))]
        print()
        if len(rounds) > 1:
            print(f"median of {len(rounds)} interleaved rounds; 'vs 1' is the median of each round's own ratio")
        print(f"{'streams':>7} {'agg tok/s':>10} {'per stream':>10} {'ms/token':>9} {'mean batch':>10} "
              f"{'vs 1':>6} {'TTFT s':>7} {'throttled':>9}")
        for r in rows:
            ratio = f"{ratios[r['streams']]:.2f}x" if r["streams"] in ratios else "-"
            thr = f"{r['throttled_s']:.0f} s" if r["throttled_s"] > 0 else "no"
            print(f"{r['streams']:>7} {r['aggregate']:>10.2f} {r['per_stream']:>10.2f} {r['ms_per_step']:>9.1f} "
                  f"{r['mean_batch']:>10.2f} {ratio:>6} {r['ttft_s']:>7.2f} {thr:>9}")
        if len(rounds) > 1:
            for n in [n for n in args.streams if n != 1] if 1 in ratios else ():
                per = ", ".join(f"{rnd[args.streams.index(n)]['aggregate'] / rnd[args.streams.index(1)]['aggregate']:.2f}"
                                for rnd in rounds)
                print(f"{n} streams vs 1, per round: {per}")
        snap = requests.get(base + "/dashboard/stats", timeout=10).json().get("thermal") or {}
        print()
        print("thermal: " + ("no thermal zones or cpufreq policies readable on this machine"
                             if not snap.get("zones") and not snap.get("policies") else
                             "the CPU throttled during the run" if any(r["throttled_s"] > 0 for r in rows)
                             else "no throttling observed during the run"))
        for n, target in ((4, 3.5), (8, 5.0)):     # the kernels issue's targets, on a quiet machine
            if n in ratios:
                got = ratios[n]
                print(f"{n} streams vs 1: {got:.2f}x (target >= {target}x): {'MET' if got >= target else 'MISSED'}")
        return 0


if __name__ == "__main__":
    sys.exit(main())
