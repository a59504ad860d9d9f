"""A multi-turn chat: time to first token per turn, cold, with the prefix cache, and after a restart.

Through the real server and its chat API: a system message of about `--history` tokens (a
document the conversation is about), then `--turns` user turns, each answered with
`--answer` tokens (greedy, ignore_eos), every turn sending the whole conversation so far, as
chat clients do. Three runs of the same conversation:
  - cold: `--disable-prefix-cache`, every turn computes its whole prompt;
  - cached: the prefix cache in memory (a turn computes what is new since the last);
  - restart: `--kv-cache-dir`, the server stopped (SIGTERM) and started again before every
    turn, so each turn's start comes back from disk.
Prints TTFT per turn and mode, the cached tokens the server reported in usage, and turn N's
speed-up (target: the last turn at least 5x faster than cold, with the cache and after a
restart).

    python bench/prefix_cache_bench.py                                 # Qwen3-0.6B-shaped random checkpoint
    python bench/prefix_cache_bench.py --history 1500 --turns 6 --answer 64 --threads 2
    python bench/prefix_cache_bench.py --model DIR --history 200 --turns 3 --answer 8   # a tiny check

Not a test: it takes minutes and its numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.concurrency_bench import bench_checkpoint  # noqa: E402
from bench.live_server import Server, load_line  # noqa: E402

DOCUMENT = ("Edge boards run language models on their CPUs with int8 kernels. Each board keeps a pool of "
            "key and value blocks, and a prompt that starts like an earlier one takes its blocks again. ")
QUESTIONS = ["What does the document say about the boards?", "How are the kernels written?",
             "Why are the blocks shared?", "What happens when the pool is full?",
             "How does a restarted board find its cache?", "Summarise the conversation so far.",
             "What would you measure next?", "Anything else?"]


def document(server: Server, tokens: int) -> str:
    """About `tokens` tokens of text, by the model's own tokenizer."""
    one = requests.post(server.base + "/tokenize", json={"prompt": DOCUMENT}, timeout=30).json()["count"]
    return DOCUMENT * max(1, round(tokens / one))


def turn(server: Server, messages: list[dict], answer: int) -> tuple[float, str, dict]:
    times: list[float] = []
    t0 = time.perf_counter()
    body = {"model": server.model, "messages": messages, "max_tokens": answer, "temperature": 0,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    text: list[str] = []
    usage = stream_text(server.base, body, times, text)
    return times[0] - t0, "".join(text), usage


def stream_text(base: str, body: dict, times: list, text: list) -> dict:
    """Stream a chat reply: token arrival times, its text (the next turn sends it back), its usage."""
    usage = {}
    with requests.post(base + "/v1/chat/completions", json={**body, "stream": True}, stream=True,
                       timeout=(10, 1800)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(chunk["error"]["message"])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta") or {}
                if delta.get("content") or delta.get("reasoning_content") or choice.get("finish_reason"):
                    times.append(time.perf_counter())
                text.append(delta.get("content") or "")
    return usage


def started(model_dir: Path, flags: list[str], args) -> Server:
    """A server, warmed by one short unrelated request (weights paged in) before the turn it serves."""
    server = Server(model_dir, *flags, threads=args.threads, log_level="warning")
    requests.post(server.base + "/v1/completions", json={"model": server.model, "prompt": "Warm up.",
                                                         "max_tokens": 1}, timeout=600).raise_for_status()
    return server


def conversation(model_dir: Path, mode: str, args, cache_dir: Path) -> list[dict]:
    flags = ["--max-context", str(args.max_context)]
    if mode == "cold":
        flags.append("--disable-prefix-cache")
    if mode == "restart":
        flags += ["--kv-cache-dir", str(cache_dir)]
    rows, messages = [], None
    server = started(model_dir, flags, args)
    try:
        messages = [{"role": "system", "content": document(server, args.history)}]
        for i in range(args.turns):
            if mode == "restart" and i:
                server.stop()
                server = started(model_dir, flags, args)
            messages.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
            seconds, reply, usage = turn(server, messages, args.answer)
            messages.append({"role": "assistant", "content": reply})
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            rows.append({"ttft": seconds, "prompt": usage.get("prompt_tokens", 0), "cached": cached})
    finally:
        server.stop()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (default: the Qwen3-0.6B-shaped random checkpoint)")
    ap.add_argument("--history", type=int, default=1500, help="tokens of the system message")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--answer", type=int, default=64, help="tokens of every answer")
    ap.add_argument("--max-context", type=int, default=8192)
    ap.add_argument("--modes", default="cold,cached,restart")
    ap.add_argument("--threads", type=int, help="engine threads (default: the engine's choice)")
    args = ap.parse_args(argv)
    model_dir = Path(args.model) if args.model else bench_checkpoint()
    cache_dir = Path(tempfile.mkdtemp(prefix="apl-kv-bench-"))
    print(f"{args.turns} turns over a {args.history}-token history, {args.answer}-token answers; {load_line()}")
    try:
        modes = args.modes.split(",")
        runs = {mode: conversation(model_dir, mode, args, cache_dir) for mode in modes}
    finally:
        shutil.rmtree(cache_dir, ignore_errors=True)
    print()
    head = f"{'turn':>4} {'prompt':>7}" + "".join(f" {m + ' TTFT':>13} {'cached':>7}" for m in modes)
    if "cold" in runs:
        head += "".join(f" {m + ' vs cold':>15}" for m in modes if m != "cold")
    print(head)
    for i in range(args.turns):
        line = f"{i + 1:>4} {runs[modes[0]][i]['prompt']:>7}"
        for m in modes:
            line += f" {runs[m][i]['ttft']:>12.2f}s {runs[m][i]['cached']:>7}"
        if "cold" in runs:
            line += "".join(f" {runs['cold'][i]['ttft'] / runs[m][i]['ttft']:>14.1f}x" for m in modes if m != "cold")
        print(line)
    if "cold" in runs:
        print()
        for m in modes:
            if m != "cold":
                ratio = runs["cold"][-1]["ttft"] / runs[m][-1]["ttft"]
                print(f"turn {args.turns} {m}: {ratio:.1f}x faster than cold (target >= 5x: "
                      f"{'met' if ratio >= 5 else 'MISSED'})")
    print(load_line() + " at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
