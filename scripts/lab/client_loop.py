#!/usr/bin/env python3
"""A bounded client loop through the load balancer: counts every failed or cut request.

    client_loop.py URL --api-key KEY --out SUMMARY.json [--stop-file F] [--max-seconds 600]
                   [--workers 2] [--max-tokens 200] [--pause 0.1]

Each worker alternates a streamed chat completion and a plain completion, each of exactly
--max-tokens tokens (ignore_eos), until the stop file appears or max-seconds pass. A
request counts as ok only if it came back whole: HTTP 200, finish_reason "length", and
usage.completion_tokens == --max-tokens; a stream must also end with [DONE] and carry no
error event (the server reports a stream it had to stop - "shutdown" - as an error event
before [DONE], with HTTP 200 already sent). Failed: no answer or an HTTP error; cut: an
answer that stopped short. Meant to run inside the lab's controller namespace.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
import urllib.error
import urllib.request


class Cut(Exception):
    """The answer started but did not come back whole."""


def post(url: str, key: str, body: dict, timeout: float = 120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    return urllib.request.urlopen(req, timeout=timeout)


def check_stream(lines, max_tokens: int) -> int:
    """Tokens of a whole SSE chat stream; raises Cut for anything short of that."""
    done, finish, usage, content_chunks = False, None, None, 0
    for raw in lines:
        line = raw.decode("utf-8", "replace").strip() if isinstance(raw, bytes) else raw.strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            raise Cut(f"error event: {event['error'].get('code')}: {event['error'].get('message')}")
        for choice in event.get("choices", []):
            if choice.get("delta", {}).get("content"):
                content_chunks += 1
            finish = choice.get("finish_reason") or finish
        usage = event.get("usage") or usage
    if not done:
        raise Cut(f"stream ended without [DONE] after {content_chunks} chunks")
    tokens = (usage or {}).get("completion_tokens")
    if finish != "length" or tokens != max_tokens:
        raise Cut(f"finish_reason {finish}, {tokens} of {max_tokens} tokens")
    return tokens


def check_plain(body: bytes, max_tokens: int) -> int:
    answer = json.loads(body)
    finish = answer["choices"][0].get("finish_reason")
    tokens = answer.get("usage", {}).get("completion_tokens")
    if finish != "length" or tokens != max_tokens:
        raise Cut(f"finish_reason {finish}, {tokens} of {max_tokens} tokens")
    return tokens


def one_request(base: str, key: str, i: int, stream: bool, max_tokens: int) -> int:
    if stream:
        with post(base + "/v1/chat/completions", key,
                  {"messages": [{"role": "user", "content": f"Tell a long story, number {i}"}],
                   "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                   "stream_options": {"include_usage": True}}) as resp:
            return check_stream(resp, max_tokens)
    with post(base + "/v1/completions", key,
              {"prompt": f"The fleet test {i}:", "max_tokens": max_tokens, "ignore_eos": True}) as resp:
        return check_plain(resp.read(), max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("url")
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file")
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--pause", type=float, default=0.1, help="seconds between a worker's requests")
    a = ap.parse_args()
    if a.max_tokens < 1 or a.workers < 1:
        ap.error("--max-tokens and --workers must be at least 1")
    base = a.url.rstrip("/")
    lock = threading.Lock()
    stats = {"ok": 0, "failed": 0, "cut": 0, "streams": 0, "tokens": 0, "errors": [], "started": time.time(),
             "longest_s": 0.0}
    deadline = time.monotonic() + a.max_seconds

    def running() -> bool:
        return time.monotonic() < deadline and not (a.stop_file and os.path.exists(a.stop_file))

    def worker(n: int) -> None:
        i = 0
        while running():
            stream = (i + n) % 2 == 0
            t0 = time.monotonic()
            try:
                tokens = one_request(base, a.api_key, i, stream, a.max_tokens)
                with lock:
                    stats["ok"] += 1
                    stats["streams"] += stream
                    stats["tokens"] += tokens
                    stats["longest_s"] = max(stats["longest_s"], round(time.monotonic() - t0, 2))
            except Cut as e:
                with lock:
                    stats["cut"] += 1
                    stats["errors"].append(f"{time.strftime('%H:%M:%S')} {'stream' if stream else 'plain'} cut: {e}")
            except (OSError, urllib.error.URLError, ValueError, KeyError, IndexError) as e:
                detail = e.read().decode("utf-8", "replace")[:200] if isinstance(e, urllib.error.HTTPError) else ""
                with lock:
                    stats["failed"] += 1
                    stats["errors"].append(f"{time.strftime('%H:%M:%S')} {'stream' if stream else 'plain'}: {e} {detail}")
            i += 1
            time.sleep(a.pause)

    threads = [threading.Thread(target=worker, args=(n,), daemon=True) for n in range(a.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats["seconds"] = round(time.time() - stats["started"], 1)
    stats["max_tokens"] = a.max_tokens
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=1)
    print(f"client loop: {stats['ok']} ok ({stats['streams']} streams, {stats['tokens']} tokens), "
          f"{stats['failed']} failed, {stats['cut']} cut in {stats['seconds']} s")


if __name__ == "__main__":
    main()
