#!/usr/bin/env python3
"""Embeddings/s and rerank pairs/s of a board's retrieval instances, through their own
/v1/embeddings and /v1/rerank (what a client gets, HTTP and batching included).

    retrieval_bench.py INSTANCES_JSON [--inputs 16] [--words 96] [--rounds 3] [--api-key-stdin]

INSTANCES_JSON: [{"unit", "port", "task"}, ...] (the appliance role's /etc/appliance/instances.json);
chat instances are left out. Prints one JSON object: {"retrieval": [{instance, task, model,
inputs, words, rounds, seconds, per_second}]}, the median round's rate. Standard library
only: bench.yml runs it with the board's python3.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import urllib.request

WORDS = ("board fan heatsink kernel token cache prefix model fleet rollout sensor thermal memory "
         "decode prefill batch stream queue drain release").split()


def text(n: int, seed: int) -> str:
    return " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(n))


def post(port: int, path: str, body: dict, key: str | None) -> dict:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(), headers=headers,
                                 method="POST")
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def measure(instance: dict, inputs: int, words: int, rounds: int, key: str | None) -> dict:
    task, port = instance["task"], int(instance["port"])
    if task == "embed":
        def one(r):
            answer = post(port, "/v1/embeddings", {"input": [text(words, r * inputs + i) for i in range(inputs)]}, key)
            assert len(answer["data"]) == inputs, answer
            return answer["model"]
    else:
        def one(r):
            answer = post(port, "/v1/rerank", {"query": text(8, r), "documents": [text(words, r * inputs + i)
                                                                               for i in range(inputs)]}, key)
            assert len(answer["results"]) == inputs, answer
            return answer["model"]
    model = one(-1)                       # warm-up: weights paged in, nothing measured
    seconds = []
    for r in range(rounds):
        t0 = time.perf_counter()
        one(r)
        seconds.append(time.perf_counter() - t0)
    median = statistics.median(seconds)
    return {"instance": instance.get("name") or instance["unit"], "task": task, "model": model, "inputs": inputs,
            "words": words, "rounds": rounds, "seconds": round(median, 4), "per_second": round(inputs / median, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("instances")
    ap.add_argument("--inputs", type=int, default=16, help="embedding inputs, or rerank documents, per request")
    ap.add_argument("--words", type=int, default=96, help="words per input (about 128 tokens)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--api-key-stdin", action="store_true", help="read the API key from stdin (never argv)")
    a = ap.parse_args()
    if min(a.inputs, a.words, a.rounds) < 1:
        ap.error("--inputs, --words and --rounds must be at least 1")
    key = sys.stdin.readline().strip() or None if a.api_key_stdin else None
    with open(a.instances, encoding="utf-8") as f:
        instances = [i for i in json.load(f) if (i.get("task") or "chat") in ("embed", "rerank")]
    try:
        rows = [measure(i, a.inputs, a.words, a.rounds, key) for i in instances]
    except (OSError, ValueError, KeyError, AssertionError) as e:
        sys.exit(f"retrieval_bench: {e}")
    json.dump({"retrieval": rows}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
