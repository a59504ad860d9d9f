"""Continuous batching, disconnects and the full queue, against the live server
(max_batch 4, max_queue 4)."""
from __future__ import annotations

import json
import socket
import threading
import time

import requests

MESSAGES = [{"role": "user", "content": "Tell me about edge boards."}]


def open_stream(server, model_id: str, max_tokens: int, timeout: float = 30.0) -> tuple[socket.socket, bytes]:
    """A raw streaming request; returns the socket (still open) and the bytes read up to the headers."""
    body = json.dumps({"model": model_id, "messages": MESSAGES, "stream": True, "max_tokens": max_tokens,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=timeout)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(4096)
        if not chunk:
            break
        buf += chunk
    return s, buf


def read_events(s: socket.socket, buf: bytes, n: int) -> bytes:
    """Read until at least n `data:` events arrived (bounded by the socket timeout)."""
    while buf.count(b"data: ") < n:
        chunk = s.recv(4096)
        if not chunk:
            break
        buf += chunk
    return buf


def cancelled(server) -> float:
    return server.metrics().get(("appliance_requests_total", (("outcome", "cancelled"),)), 0.0)


def test_concurrent_streams_all_complete(openai_client, idle_server, model_id):
    n, max_tokens = 8, 40
    results: dict[int, object] = {}

    def run(i):
        try:
            text, finish, usage = "", None, None
            stream = openai_client.chat.completions.create(
                model=model_id, messages=[{"role": "user", "content": f"Request number {i}"}], max_tokens=max_tokens,
                stream=True, stream_options={"include_usage": True}, temperature=0.8, seed=i,
                extra_body={"ignore_eos": True})
            for c in stream:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                    finish = c.choices[0].finish_reason or finish
                if c.usage:
                    usage = c.usage
            results[i] = (text, finish, usage)
        except Exception as e:  # reported below, with the others
            results[i] = e

    before = idle_server.metrics()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == n and not any(isinstance(r, Exception) for r in results.values()), results
    for text, finish, usage in results.values():
        assert finish == "length" and usage.completion_tokens == max_tokens and text
    after = idle_server.wait_idle() and idle_server.metrics()
    generated = after[("appliance_generation_tokens_total", ())] - before[("appliance_generation_tokens_total", ())]
    assert generated == n * max_tokens                                  # nothing lost, nothing doubled
    # batching happened: some decode steps carried more than one sequence
    steps = after[("appliance_decode_batch_size_count", ())] - before[("appliance_decode_batch_size_count", ())]
    tokens = after[("appliance_decode_batch_size_sum", ())] - before[("appliance_decode_batch_size_sum", ())]
    assert tokens / steps > 1.5, (tokens, steps)
    single = (after[("appliance_decode_batch_size_bucket", (("le", "1.0"),))]
              - before[("appliance_decode_batch_size_bucket", (("le", "1.0"),))])
    assert single < steps


def test_disconnect_mid_stream_frees_the_slot(idle_server, model_id):
    before = cancelled(idle_server)
    s, buf = open_stream(idle_server, model_id, max_tokens=1900)
    buf = read_events(s, buf, 5)
    assert b" 200 " in buf.split(b"\r\n")[0] and buf.count(b"data: ") >= 5
    assert idle_server.health()["queue"]["running"] == 1
    s.close()
    t0 = time.monotonic()
    q = idle_server.wait_idle(timeout=5)
    freed_after = time.monotonic() - t0
    assert q["running"] == 0 and q["kv_blocks_used"] == 0
    assert cancelled(idle_server) == before + 1          # cancelled, not finished by itself
    assert freed_after < 2.0


def test_full_queue_answers_503_with_retry_after(idle_server, model_id):
    socks = []
    try:
        for _ in range(8):                               # 4 decode slots + 4 queue places
            s, buf = open_stream(idle_server, model_id, max_tokens=1900)
            assert b" 200 " in buf.split(b"\r\n")[0], buf
            socks.append(s)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            q = idle_server.health()["queue"]
            if q["running"] == 4 and q["waiting"] == 4:
                break
            time.sleep(0.05)
        assert (q["running"], q["waiting"]) == (4, 4), q
        r = requests.post(idle_server.base + "/v1/chat/completions", timeout=10,
                          json={"model": model_id, "messages": MESSAGES, "max_tokens": 4})
        assert r.status_code == 503
        assert int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        assert requests.get(idle_server.base + "/health", timeout=5).status_code == 200   # probes still answer
        rejected = idle_server.metrics()[("appliance_requests_total", (("outcome", "rejected"),))]
        assert rejected >= 1
    finally:
        for s in socks:
            s.close()
    q = idle_server.wait_idle(timeout=10)                # queued and running ones are all cancelled
    assert q["kv_blocks_used"] == 0


def test_non_streaming_client_that_leaves_is_cancelled(idle_server, model_id):
    before = cancelled(idle_server)
    body = json.dumps({"model": model_id, "messages": MESSAGES, "max_tokens": 1900, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", idle_server.port), timeout=10)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: "
              + str(len(body)).encode() + b"\r\n\r\n" + body)
    deadline = time.monotonic() + 10
    while idle_server.health()["queue"]["running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    s.close()
    idle_server.wait_idle(timeout=5)
    assert cancelled(idle_server) == before + 1
