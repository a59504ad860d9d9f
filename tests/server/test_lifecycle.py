"""Loading, API keys and SIGTERM draining."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import pytest
import requests

from live_server import start_server, wait_ready

KEY = "test-key-0123456789"


def test_health_503_while_loading_then_200(monkeypatch, server_model_dir):
    """In process: the model loads in a background thread; /health says so until it is done."""
    import appliance
    from appliance.config import Settings
    from appliance.server import create_app

    gate = threading.Event()
    real_load = appliance.Engine.load.__func__

    def slow_load(cls, *a, **kw):
        assert gate.wait(30)
        return real_load(cls, *a, **kw)

    monkeypatch.setattr(appliance.Engine, "load", classmethod(slow_load))
    app = create_app({"settings": Settings(model=str(server_model_dir), max_context=256, sysfs_root="/nonexistent")})
    client = app.test_client()
    try:
        r = client.get("/health")
        assert r.status_code == 503 and r.json["status"] == "loading"
        assert client.get("/ready").status_code == 503
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json["error"]["code"] == "model_loading" and r.headers["Retry-After"]
        gate.set()
        assert app.extensions["appliance"].ready_event.wait(60)
        r = client.get("/health")
        assert r.status_code == 200 and r.json["status"] == "ready"
        facts = r.json["model"]
        assert facts["id"] == server_model_dir.name and facts["max_context"] == 256
        assert facts["layers"] == 2 and facts["weights"] == "q8" and facts["kv"] == "q8"
        assert client.get("/ready").status_code == 200
    finally:
        app.extensions["appliance"].close()


def test_health_reports_the_load_as_it_goes(monkeypatch, server_model_dir):
    """While the weights load, /health says which stage and how far (a first load of a large
    model quantizes for minutes: "loading" alone does not tell alive from stuck)."""
    import appliance
    from appliance.config import Settings
    from appliance.server import create_app

    gate = threading.Event()
    real_load = appliance.Engine.load.__func__

    def load_in_stages(cls, *a, **kw):
        kw["on_progress"]("quantizing", 3, 10)
        assert gate.wait(30)
        return real_load(cls, *a, **kw)

    monkeypatch.setattr(appliance.Engine, "load", classmethod(load_in_stages))
    app = create_app({"settings": Settings(model=str(server_model_dir), max_context=256, sysfs_root="/nonexistent")})
    client = app.test_client()
    try:
        deadline = time.monotonic() + 10
        while "load" not in client.get("/health").json and time.monotonic() < deadline:
            time.sleep(0.02)
        r = client.get("/health")
        assert r.status_code == 503 and r.json["status"] == "loading"
        assert {k: r.json["load"][k] for k in ("stage", "done", "total")} == {"stage": "quantizing", "done": 3,
                                                                             "total": 10}
        gate.set()
        assert app.extensions["appliance"].ready_event.wait(60)
        assert "load" not in client.get("/health").json
    finally:
        app.extensions["appliance"].close()


def test_failed_load_is_reported(tmp_path):
    from appliance.config import Settings
    from appliance.server import create_app

    (tmp_path / "config.json").write_text("{not json")
    app = create_app({"settings": Settings(model=str(tmp_path), sysfs_root="/nonexistent")})
    rt = app.extensions["appliance"]
    try:
        assert rt.ready_event.wait(30)
        r = app.test_client().get("/health")
        assert r.status_code == 503 and r.json["status"] == "failed" and "config.json" in r.json["error"]
        r = app.test_client().get("/v1/models")
        assert r.status_code == 503 and r.json["error"]["code"] == "model_load_failed"
    finally:
        rt.close()


def test_a_missing_model_directory_is_reported_by_health(tmp_path):
    """A model directory gone by the time the server loads (an unmounted disk, a rollout that
    removed it): the server stays up, /health and every API call say which directory and why."""
    from appliance.config import Settings
    from appliance.server import create_app

    missing = tmp_path / "models" / "qwen3-gone"
    app = create_app({"settings": Settings(model=str(missing), sysfs_root="/nonexistent")})
    rt = app.extensions["appliance"]
    try:
        assert rt.ready_event.wait(30)
        r = app.test_client().get("/health")
        assert r.status_code == 503 and r.json["status"] == "failed", r.json
        assert str(missing) in r.json["error"], r.json
        r = app.test_client().post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json["error"]["code"] == "model_load_failed"
        assert str(missing) in r.json["error"]["message"]
        assert app.test_client().get("/openapi.json").status_code == 200     # still describes itself
    finally:
        rt.close()


def test_serve_with_a_missing_model_stays_up_and_says_why(tmp_path):
    """`appliance serve --model /gone`: one line on stderr, then a live server whose /health
    names the directory (systemd sees a running unit, the health gate a reason, not a crash loop)."""
    missing = tmp_path / "gone"
    srv = start_server(missing, wait=False)
    try:
        deadline = time.monotonic() + 60
        body = None
        while time.monotonic() < deadline and srv.proc.poll() is None:
            try:
                r = srv.get("/health", timeout=5)
                if r.json().get("status") == "failed":
                    body = r
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        assert body is not None, srv.log()[-2000:]
        assert body.status_code == 503 and str(missing) in body.json()["error"]
        assert srv.get("/ready").status_code == 503
        r = srv.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
        assert f"appliance serve: model: '{missing}' is not a directory" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()[-2000:]


def test_embedded_default_model_in_process():
    """Without a model directory the server serves the embedded demo model."""
    from appliance.config import Settings
    from appliance.server import create_app

    app = create_app({"settings": Settings(sysfs_root="/nonexistent", max_context=256)})
    rt = app.extensions["appliance"]
    try:
        assert rt.ready_event.wait(60) and rt.status == "ready", rt.error
        c = app.test_client()
        model = c.get("/v1/models").json["data"][0]["id"]
        r = c.post("/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200 and r.json["usage"]["completion_tokens"] == 3
    finally:
        rt.close()


@pytest.fixture(scope="module")
def keyed_server(server_model_dir):
    srv = start_server(server_model_dir, "--max-batch", "2", "--max-queue", "2", "--max-context", "2048",
                       "--grace-period", "30", api_key=KEY)
    yield srv
    srv.stop(signal.SIGKILL)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key-000000000"},
                                     {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": "Bearer "}])
@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("POST", "/v1/chat/completions"),
                                          ("POST", "/v1/completions"), ("POST", "/tokenize"),
                                          ("POST", "/detokenize")])
def test_api_key_required(keyed_server, headers, method, path):
    r = requests.request(method, keyed_server.base + path, headers=headers, json={"prompt": "x"}, timeout=10)
    assert r.status_code == 401
    assert r.json()["error"]["code"] == "invalid_api_key" and "Bearer" in r.headers["WWW-Authenticate"]


def test_api_key_accepted_and_probes_open(keyed_server):
    from openai import AuthenticationError, OpenAI

    good = OpenAI(base_url=keyed_server.base + "/v1", api_key=KEY, max_retries=0, timeout=30)
    model = good.models.list().data[0].id
    r = good.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert r.choices[0].message.role == "assistant"
    bad = OpenAI(base_url=keyed_server.base + "/v1", api_key="wrong-key-123456", max_retries=0, timeout=30)
    with pytest.raises(AuthenticationError):
        bad.models.list()
    for path in ("/health", "/metrics", "/ready", "/"):
        assert requests.get(keyed_server.base + path, timeout=10).status_code == 200, path
    assert KEY not in requests.get(keyed_server.base + "/health", timeout=10).text
    assert KEY not in requests.get(keyed_server.base + "/dashboard/stats", timeout=10).text


def test_sigterm_finishes_running_requests_then_exits(keyed_server):
    """The last test of the module: it stops the keyed server."""
    model = keyed_server.get("/v1/models").json()["data"][0]["id"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "Go on"}], "stream": True,
                       # long enough to be running when the signal lands, on a fast machine too (the
                       # tiny model decodes 200 tokens in well under a second there)
                       "max_tokens": 1500, "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", keyed_server.port), timeout=30)
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " + str(len(body)).encode()
              + b"\r\n\r\n" + body)
    raw = b""
    while raw.count(b"data: ") < 3:
        chunk = s.recv(4096)
        assert chunk, raw
        raw += chunk
    t0 = time.monotonic()
    keyed_server.proc.send_signal(signal.SIGTERM)
    # While the stream drains, new requests and the readiness probe are answered 503 at once
    # (a load balancer must not wait for its own timeout to learn the board is going away).
    deadline = time.monotonic() + 10
    while requests.get(keyed_server.base + "/ready", timeout=5).status_code == 200:
        assert time.monotonic() < deadline, "/ready still 200 after SIGTERM"
        time.sleep(0.05)
    t1 = time.monotonic()
    refused = requests.post(keyed_server.base + "/v1/completions", json={"prompt": "x"}, timeout=5,
                            headers={"Authorization": f"Bearer {KEY}"})
    assert refused.status_code == 503 and refused.headers.get("Retry-After")
    assert refused.json()["error"]["code"] == "shutting_down" and time.monotonic() - t1 < 5
    while chunk := s.recv(65536):
        raw += chunk
    s.close()
    events = [line for line in raw.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"          # it ran to the end, not cut off
    keyed_server.proc.wait(40)
    assert keyed_server.proc.returncode == 0
    assert time.monotonic() - t0 < 40
    assert "draining: 1 running" in keyed_server.log()       # the stream was running when the drain began


def test_sigterm_grace_period_ends_long_requests(server_model_dir):
    srv = start_server(server_model_dir, "--max-context", "2048", "--grace-period", "1",
                       env={"APPLIANCE_REQUEST_TIMEOUT": "60"})
    try:
        model = srv.get("/v1/models").json()["data"][0]["id"]
        result = {}

        def long_request():
            try:
                result["r"] = requests.post(srv.base + "/v1/completions", timeout=30, json={
                    "model": model, "prompt": "x", "max_tokens": 2000, "ignore_eos": True})
            except requests.RequestException as e:
                result["r"] = e

        t = threading.Thread(target=long_request)
        t.start()
        deadline = time.monotonic() + 10
        while srv.health()["queue"]["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(30)
        srv.proc.wait(20)
        assert srv.proc.returncode == 0
        r = result["r"]
        # Either it finished inside the second of grace, or it was ended with a 503 "shutdown".
        if isinstance(r, requests.Response) and r.status_code != 200:
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutdown"
    finally:
        srv.stop(signal.SIGKILL)


def test_readiness_of_a_fresh_server(server_model_dir):
    """/health answers (503, then 200) from the moment gunicorn listens."""
    srv = start_server(server_model_dir, "--max-context", "512", wait=False)
    try:
        codes = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and 200 not in codes:
            try:
                codes.add(requests.get(srv.base + "/health", timeout=2).status_code)
            except requests.ConnectionError:
                time.sleep(0.02)
        wait_ready(srv)
        assert 200 in codes and codes <= {200, 503}
    finally:
        srv.stop()


def test_time_limit_answers_504_or_ends_the_stream_with_an_error(server_model_dir):
    from appliance.config import Settings
    from appliance.server import create_app

    app = create_app({"settings": Settings(model=str(server_model_dir), max_context=2048, request_timeout=0.3,
                                           sysfs_root="/nonexistent")})
    rt = app.extensions["appliance"]
    try:
        assert rt.ready_event.wait(60) and rt.ready
        c = app.test_client()
        body = {"prompt": "Once upon", "max_tokens": 2000, "ignore_eos": True}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 504 and r.json["error"]["code"] == "request_timeout"
        assert "0.3 s" in r.json["error"]["message"]
        r = c.post("/v1/completions", json={**body, "stream": True})
        events = [line for line in r.get_data(as_text=True).split("\n") if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "request_timeout"
        m = rt.metrics.render()[0].decode()
        assert 'appliance_requests_total{outcome="timeout"} 2.0' in m
    finally:
        rt.close()
