#!/usr/bin/env python3
"""A bounded client loop through the load balancer: counts every failed request.

    client_loop.py URL --api-key KEY --out SUMMARY.json [--stop-file F] [--max-seconds 600]
                   [--workers 2] [--pause 0.1]

Each worker alternates a plain completion and a streamed chat completion (the stream
must end with [DONE]) until the stop file appears or max-seconds pass. Meant to run
inside the lab's controller namespace; it talks only to URL.
"""
import argparse
import json
import os
import threading
import time
import urllib.error
import urllib.request


def post(url: str, key: str, body: dict, stream: bool) -> None:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}")
        data = resp.read().decode("utf-8", "replace")
    if stream:
        if "data: [DONE]" not in data:
            raise RuntimeError("stream ended without [DONE]")
    else:
        json.loads(data)["choices"][0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--stop-file")
    ap.add_argument("--max-seconds", type=float, default=600)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--pause", type=float, default=0.1, help="seconds between a worker's requests")
    a = ap.parse_args()
    base = a.url.rstrip("/")
    lock = threading.Lock()
    stats = {"ok": 0, "failed": 0, "errors": [], "started": time.time()}
    deadline = time.monotonic() + a.max_seconds

    def running() -> bool:
        return time.monotonic() < deadline and not (a.stop_file and os.path.exists(a.stop_file))

    def worker(n: int) -> None:
        i = 0
        while running():
            stream = (i + n) % 2 == 1
            try:
                if stream:
                    post(base + "/v1/chat/completions", a.api_key,
                         {"messages": [{"role": "user", "content": f"Hello number {i}"}],
                          "max_tokens": a.max_tokens, "stream": True}, True)
                else:
                    post(base + "/v1/completions", a.api_key,
                         {"prompt": f"The fleet test {i}:", "max_tokens": a.max_tokens}, False)
                with lock:
                    stats["ok"] += 1
            except (OSError, urllib.error.URLError, RuntimeError, ValueError, KeyError, IndexError) as e:
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
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(stats, f, indent=1)
    print(f"client loop: {stats['ok']} ok, {stats['failed']} failed in {stats['seconds']} s")


if __name__ == "__main__":
    main()
