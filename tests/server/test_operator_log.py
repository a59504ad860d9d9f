"""What the server's log tells its operator: that it is ready (with what), and one line per request
without the text of prompts or replies."""
from __future__ import annotations

import json
import re
import time

import requests


def wait_for_line(server, pattern: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = re.findall(pattern, server.log(), flags=re.M)
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no log line matching {pattern!r}:\n{server.log()[-3000:]}")


def test_one_access_line_per_request_without_the_text(idle_server, model_id):
    secret = "a prompt nobody else should read"
    r = idle_server.post("/v1/completions", json={"model": model_id, "prompt": secret, "max_tokens": 3})
    assert r.status_code == 200
    line = wait_for_line(idle_server, r"^.*POST /v1/completions 200 [\d.]+ ms.*$")
    assert secret not in idle_server.log()
    with requests.post(idle_server.base + "/v1/completions", stream=True, timeout=60,
                       json={"model": model_id, "prompt": "x", "max_tokens": 4, "stream": True}) as s:
        chunks = list(s.iter_lines())
    assert chunks
    wait_for_line(idle_server, r"^.*POST /v1/completions 200 [\d.]+ ms.*$")
    assert idle_server.post("/v1/completions", json={"model": model_id}).status_code == 400
    wait_for_line(idle_server, r"^.*POST /v1/completions 400 [\d.]+ ms.*$")
    assert "appliance.access" in line


def test_probes_that_succeed_stay_out_of_the_info_log(idle_server):
    before = idle_server.log().count("GET /health")
    for _ in range(3):
        assert idle_server.get("/health").status_code == 200
    idle_server.get("/v1/chat/completions")          # 405: logged, it is not a probe
    wait_for_line(idle_server, r"^.*GET /v1/chat/completions 405 .*$")
    assert idle_server.log().count("GET /health") == before


def test_the_log_says_when_the_server_serves_and_with_what(idle_server, server_model_dir):
    line = wait_for_line(idle_server, r"^.*serving .*$")
    assert server_model_dir.name in line and "q8 weights" in line and "KV pool of" in line
    assert "threads" in line and re.search(r"loaded in [\d.]+ s", line)


def test_the_access_line_carries_the_usage(idle_server, model_id):
    r = idle_server.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 3, "temperature": 0,
                                                        "messages": [{"role": "user", "content": "count to three"}]})
    usage = r.json()["usage"]
    line = wait_for_line(idle_server, r"^.*POST /v1/chat/completions 200 [\d.]+ ms.*prompt_tokens=.*$")
    assert f"prompt_tokens={usage['prompt_tokens']} completion_tokens={usage['completion_tokens']}" in line
    with requests.post(idle_server.base + "/v1/completions", stream=True, timeout=60,
                       json={"model": model_id, "prompt": "a streamed one", "max_tokens": 5, "stream": True,
                             "stream_options": {"include_usage": True}, "ignore_eos": True}) as s:
        chunks = [ln for ln in s.iter_lines() if ln.startswith(b"data: {")]
    streamed = json.loads(chunks[-1][6:])["usage"]
    line = wait_for_line(idle_server, rf"^.*POST /v1/completions 200 [\d.]+ ms prompt_tokens="
                                      rf"{streamed['prompt_tokens']} completion_tokens=5$")
    assert streamed["completion_tokens"] == 5 and line


def test_the_session_key_reaches_the_scheduler_log(idle_server, model_id):
    r = idle_server.post("/v1/completions", headers={"X-Session-Id": "kiosk-7-conversation-42"},
                         json={"model": model_id, "prompt": "hello", "max_tokens": 1})
    assert r.status_code == 200
    wait_for_line(idle_server, r"^.*request \d+: \d+ prompt tokens.*\(session kiosk-7-conversation-42\)$")
    r = idle_server.post("/v1/completions", headers={"X-Session-Id": "x" * 200},
                         json={"model": model_id, "prompt": "hello", "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "X-Session-Id"
