"""A client that stops reading its stream (without closing the connection) neither slows the
other streams nor holds its KV blocks past the request time limit."""
from __future__ import annotations

import json
import shutil
import socket
import statistics
import time

import pytest
import requests

from live_server import start_server

REQUEST_TIMEOUT_S = 8


@pytest.fixture(scope="module")
def short_limit_server(server_model_dir):
    srv = start_server(server_model_dir, "--max-batch", "4", "--max-queue", "4", "--max-context", "1024",
                       "--request-timeout", str(REQUEST_TIMEOUT_S), "--grace-period", "2",
                       "--disable-prefix-cache")
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)


def stalled_stream(server, model_id: str) -> socket.socket:
    """A streaming request whose client never reads: a tiny receive buffer, so the server's
    writes block as soon as the kernel's buffers fill."""
    body = json.dumps({"model": model_id, "prompt": "x" * 20, "stream": True, "max_tokens": 100000,
                       "ignore_eos": True, "logprobs": 5}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", server.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def token_gaps(server, model_id: str, n: int) -> list[float]:
    """Seconds between the streamed events of one well-behaved stream."""
    times = []
    with requests.post(server.base + "/v1/completions", stream=True, timeout=60,
                       json={"model": model_id, "prompt": "hello", "stream": True, "max_tokens": n,
                             "ignore_eos": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                times.append(time.monotonic())
    return [b - a for a, b in zip(times, times[1:])]


def ended(server) -> float:
    """Requests that ran to their time or length limit so far."""
    m = server.metrics()
    return sum(m.get(("appliance_requests_total", (("outcome", o),)), 0.0) for o in ("timeout", "length"))


def test_a_stalled_reader_does_not_slow_others_or_keep_its_blocks(short_limit_server):
    srv = short_limit_server
    model_id = srv.get("/v1/models").json()["data"][0]["id"]
    alone = token_gaps(srv, model_id, 24)
    ended_before = ended(srv)
    opened = time.monotonic()
    stalled = [stalled_stream(srv, model_id) for _ in range(2)]
    try:
        time.sleep(1.0)                                      # their buffers are full by now
        beside = token_gaps(srv, model_id, 24)
        # Batched with the stalled ones a step can cost a little more; a stream blocked behind
        # an unread socket would stop for seconds.
        assert max(beside) < max(1.0, 5 * statistics.median(alone) + 0.5), (alone, beside)
        # Their generation ends at the time limit (or at the context limit, whichever comes first)
        # although nobody reads them: the blocks are free by then, the HTTP threads still blocked.
        deadline = opened + REQUEST_TIMEOUT_S + 5
        while time.monotonic() < deadline:
            q = srv.health()["queue"]
            if q["running"] == 0 and q["kv_blocks_used"] == 0:
                break
            time.sleep(0.2)
        else:
            raise AssertionError(f"stalled streams still hold the engine: {srv.health()['queue']}")
        assert ended(srv) - ended_before >= 3                 # the two stalled ones and `beside`
    finally:
        for s in stalled:
            s.close()
    srv.wait_idle()
    assert srv.post("/v1/completions", json={"model": model_id, "prompt": "y", "max_tokens": 2}).status_code == 200
