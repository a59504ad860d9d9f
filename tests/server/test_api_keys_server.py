"""Named API keys on a live server (gunicorn): every listed key works with the openai SDK, the
key's name shows in the access log and in appliance_client_requests, and rewriting the file
revokes and adds keys without a restart while a client keeps going."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest
import requests

from live_server import start_server

KEYS = {"billing-app": "key-billing-0001", "kiosk-2": "key-kiosk-00002"}
SINGLE = "single-key-0001"


def write_keys(path, keys: dict[str, str]) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text("".join(f"{name} {key}\n" for name, key in keys.items()))
    os.replace(tmp, path)


@pytest.fixture(scope="module")
def keys_server(server_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "api-keys"
    write_keys(path, KEYS)
    srv = start_server(server_model_dir, "--max-batch", "2", "--max-queue", "4", "--max-context", "512",
                       "--grace-period", "1", "--api-keys-file", str(path), api_key=SINGLE)
    srv.keys_path = path
    yield srv
    srv.stop(signal.SIGKILL)


def status(server, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.get(server.base + "/v1/models", headers=headers, timeout=10).status_code


def client_series(server) -> dict[tuple[str, str], float]:
    text = requests.get(server.base + "/metrics", timeout=10).text
    return {(c, s): float(v) for c, s, v in
            re.findall(r'^appliance_client_requests_total\{client="([^"]*)",status="([^"]*)"\} (\S+)$', text, re.M)}


def worker_started(server) -> str:
    text = requests.get(server.base + "/metrics", timeout=10).text
    return re.search(r"^process_start_time_seconds (\S+)$", text, re.M).group(1)


def test_each_listed_key_works_and_its_name_is_logged_and_counted(keys_server):
    from openai import AuthenticationError, OpenAI

    for name, key in KEYS.items():
        client = OpenAI(base_url=keys_server.base + "/v1", api_key=key, max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        reply = client.completions.create(model=model, prompt="Hello", max_tokens=2)
        assert reply.choices[0].text is not None
    assert status(keys_server, SINGLE) == 200                # the api_key setting keeps working
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=keys_server.base + "/v1", api_key="key-unknown-0001", max_retries=0).models.list()
    deadline = time.monotonic() + 10
    while "client=kiosk-2" not in keys_server.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    log = keys_server.log()
    assert re.search(r"POST /v1/completions 200 [\d.]+ ms client=billing-app", log), log[-2000:]
    assert re.search(r"GET /v1/models 401 [\d.]+ ms client=-", log), log[-2000:]
    assert not any(key in log for key in [*KEYS.values(), SINGLE]), "a key reached the log"
    # without X-Session-Id a request's session is its key's name (as the balancer routes it)
    assert re.search(r"prompt tokens, \d+ from the prefix cache \(session billing-app\)", log), log[-2000:]
    series = client_series(keys_server)
    assert series[("billing-app", "2xx")] >= 2 and series[("kiosk-2", "2xx")] >= 2
    assert series[("api_key", "2xx")] >= 1 and series[("-", "4xx")] >= 1
    metrics = requests.get(keys_server.base + "/metrics", timeout=10).text
    assert not any(key in metrics for key in KEYS.values())


def test_rewriting_the_file_revokes_and_adds_keys_without_a_restart(keys_server):
    started = worker_started(keys_server)
    failures, done = [], threading.Event()

    def loop():                                              # another client, all along the rotation
        while not done.is_set():
            code = status(keys_server, KEYS["billing-app"])
            if code != 200:
                failures.append(code)
            time.sleep(0.01)

    looper = threading.Thread(target=loop)
    looper.start()
    try:
        assert status(keys_server, KEYS["kiosk-2"]) == 200
        write_keys(keys_server.keys_path, {"billing-app": KEYS["billing-app"], "kiosk-3": "key-kiosk-00003"})
        assert status(keys_server, KEYS["kiosk-2"]) == 401     # revoked: the very next request
        assert status(keys_server, "key-kiosk-00003") == 200
        broken = keys_server.keys_path.with_name("broken")      # (written whole: a file caught
        broken.write_text("billing-app short\n")                # mid-write is another matter)
        os.replace(broken, keys_server.keys_path)                # a broken file keeps the last keys
        assert status(keys_server, "key-kiosk-00003") == 200
        write_keys(keys_server.keys_path, {"billing-app": KEYS["billing-app"], "kiosk-3": "key-kiosk-00003"})
        time.sleep(0.3)
    finally:
        done.set()
        looper.join()
    assert not failures, failures
    assert "api_keys_file" in keys_server.log() and "keeping the 2 keys read before" in keys_server.log()
    assert worker_started(keys_server) == started, "the server restarted"
    assert keys_server.proc.poll() is None
