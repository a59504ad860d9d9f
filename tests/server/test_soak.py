"""A soak through gunicorn: 2,000 requests of mixed shapes (stream and not, short and long
prompts, cancelled midway, malformed, token counting), more at once than the server admits.

Every request is answered (2xx), refused with 503 and Retry-After, or rejected with a JSON
4xx: never a 5xx, never lost. Afterwards the server holds no KV blocks for requests, and
its resident memory stayed within 5% of what it was after the first 200 requests.
"""
from __future__ import annotations

import json
import random
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests

from live_server import serving

pytestmark = pytest.mark.slow

TOTAL = 2000
WARMUP = 200
CLIENTS = 12                 # more than max_batch + max_queue (8): some requests meet a full queue
RSS_DRIFT = 0.05


@pytest.fixture(scope="module")
def soak_server(server_model_dir):
    # A pool of two contexts: the warm-up has touched every page of it, so what grows after is a leak.
    # The thermal history (300 samples) fills within the warm-up too: bounded buffers still
    # filling are not a leak.
    with serving(server_model_dir, "--max-batch", "4", "--max-queue", "4", "--max-context", "1024",
                 "--kv-cache-tokens", "2048", "--request-timeout", "60", "--grace-period", "3",
                 env={"APPLIANCE_THERMAL_INTERVAL": "0.02"}) as srv:
        yield srv


def worker_rss(srv) -> int:
    """Resident bytes of gunicorn's worker (the process that holds the model)."""
    master = psutil.Process(srv.proc.pid)
    children = master.children(recursive=True)
    return max(c.memory_info().rss for c in children)


def one_request(srv, model_id: str, i: int) -> str:
    """Send request i (its shape chosen by i) and classify the answer."""
    rng = random.Random(i)
    kind = rng.choice(["chat", "chat", "completion", "stream", "stream", "long", "cancel", "malformed",
                       "tokenize"])
    url = srv.base
    try:
        if kind == "chat":
            r = requests.post(url + "/v1/chat/completions", timeout=60, json={
                "model": model_id, "messages": [{"role": "user", "content": f"hello {i}"}],
                "max_tokens": rng.randint(1, 6)})
        elif kind == "completion":
            r = requests.post(url + "/v1/completions", timeout=60, json={
                "model": model_id, "prompt": f"count {i}", "max_tokens": rng.randint(1, 6), "temperature": 0.7})
        elif kind == "stream":
            r = requests.post(url + "/v1/completions", timeout=60, stream=True, json={
                "model": model_id, "prompt": f"stream {i}", "max_tokens": rng.randint(2, 10), "stream": True})
            if r.status_code == 200:
                lines = [line for line in r.iter_lines() if line.startswith(b"data: ")]
                if lines[-1] != b"data: [DONE]":
                    return "lost"
        elif kind == "long":
            r = requests.post(url + "/v1/completions", timeout=60, json={
                "model": model_id, "prompt": " ".join(f"word{j}" for j in range(rng.randint(60, 200))),
                "max_tokens": 2})
        elif kind == "cancel":
            return cancel_midway(srv, model_id, i)
        elif kind == "malformed":
            bad = rng.choice([b"{not json", json.dumps({"model": model_id, "prompt": 5}).encode(),
                              json.dumps({"model": model_id, "messages": "hi"}).encode(),
                              json.dumps({"model": model_id, "prompt": "x", "max_tokens": -1}).encode()])
            r = requests.post(url + "/v1/completions", data=bad, timeout=60,
                              headers={"Content-Type": "application/json"})
            if r.status_code >= 500 or not (400 <= r.status_code < 500) or "error" not in r.json():
                return f"bad {r.status_code}"
            return "4xx"
        else:
            r = requests.post(url + "/tokenize", timeout=60, json={"model": model_id, "prompt": f"some text {i}"})
    except requests.RequestException as e:
        return f"lost: {type(e).__name__}"
    if r.status_code == 503:
        return "503" if r.headers.get("Retry-After") else "503 without Retry-After"
    if r.status_code >= 500:
        return f"{r.status_code}"
    return "ok" if r.status_code == 200 else f"unexpected {r.status_code}"


def cancel_midway(srv, model_id: str, i: int) -> str:
    body = json.dumps({"model": model_id, "prompt": f"cancel {i}", "stream": True, "max_tokens": 64,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        buf = b""
        while buf.count(b"data: ") < 2:
            chunk = s.recv(4096)
            if not chunk:
                break
            buf += chunk
    status = buf.split(b" ", 2)[1] if buf.startswith(b"HTTP/1.1 ") else b"?"
    if status == b"503":
        return "503" if b"Retry-After" in buf else "503 without Retry-After"
    return "ok" if status == b"200" else f"unexpected {status.decode(errors='replace')}"


def test_soak_mixed_requests_lose_nothing_and_leak_nothing(soak_server):
    srv = soak_server
    model_id = srv.get("/v1/models").json()["data"][0]["id"]
    outcomes: Counter = Counter()
    lock = threading.Lock()
    rss_after_warmup = None
    t0 = time.monotonic()

    latencies = []

    def run(i):
        t = time.monotonic()
        result = one_request(srv, model_id, i)
        with lock:
            outcomes[result] += 1
            latencies.append(time.monotonic() - t)

    with ThreadPoolExecutor(CLIENTS) as pool:
        list(pool.map(run, range(WARMUP)))
        srv.wait_idle(60)
        time.sleep(max(0.0, 300 * 0.02 + 1 - (time.monotonic() - t0)))     # the thermal history is full
        rss_after_warmup = worker_rss(srv)
        list(pool.map(run, range(WARMUP, TOTAL)))
    seconds = time.monotonic() - t0
    srv.wait_idle(60)                                    # no request holds KV blocks any more
    rss_end = worker_rss(srv)
    drift = (rss_end - rss_after_warmup) / rss_after_warmup
    latencies.sort()
    print(f"soak: {TOTAL} requests in {seconds:.0f} s, outcomes {dict(outcomes)}, latency p50 "
          f"{latencies[len(latencies) // 2]:.2f} s p99 {latencies[int(0.99 * len(latencies))]:.2f} s, RSS after "
          f"{WARMUP}: {rss_after_warmup / 2**20:.1f} MiB, at the end {rss_end / 2**20:.1f} MiB ({100 * drift:+.1f}%)")
    assert sum(outcomes.values()) == TOTAL
    assert set(outcomes) <= {"ok", "503", "4xx"}, outcomes
    assert outcomes["ok"] > TOTAL // 2
    assert abs(drift) <= RSS_DRIFT
    health = srv.health()
    assert health["status"] == "ready" and health["queue"]["kv_blocks_used"] == 0
    m = srv.metrics()
    assert m.get(("appliance_requests_total", (("outcome", "error"),)), 0) == 0
