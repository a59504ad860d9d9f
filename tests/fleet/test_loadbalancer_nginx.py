"""The load balancer's configuration run by the real nginx and its njs router (Debian's nginx
and libnginx-mod-http-js) in front of stand-in board instances on 127.0.0.1: routing by
the request's `model` and by path, the body reaching the instance whole, sessions staying on
one instance, /v1/models listing every instance's models, streams passing through."""
from __future__ import annotations

import http.server
import json
import os
import re
import socketserver
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import render_role_template, tool

NJS_MODULE = Path("/usr/lib/nginx/modules/ngx_http_js_module.so")
KEY = "Bearer fleet-test-key"
CHAT = {"board1/chat", "board2/chat", "board2/big"}        # every chat instance: the path's route


class Instance(http.server.ThreadingHTTPServer):
    """One board instance: answers which instance it is, what it received, and its models."""

    def __init__(self, label: str, models: list[str]):
        self.label, self.models = label, models
        super().__init__(("127.0.0.1", 0), InstanceHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server_address[1]


class InstanceHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.headers.get("Authorization") != KEY:
            return self.reply(401, {"error": {"message": "missing API key"}})
        self.reply(200, {"object": "list", "data": [{"id": m, "object": "model"} for m in self.server.models]})

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        parsed = json.loads(body)
        if parsed.get("stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for n in range(3):
                event = f"data: {json.dumps({'n': n, 'by': self.server.label})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n")
            return
        self.reply(200, {"by": self.server.label, "path": self.path, "bytes": len(body),
                         "session": self.headers.get("X-Session-Id")})

    def log_message(self, *args):
        pass


class KeepAliveBoard(socketserver.ThreadingTCPServer):
    """A board's HTTP server as the balancer meets it: it keeps an idle connection for
    `keepalive` seconds, then closes it. That close can cross a request the balancer has just
    sent on the connection; this stand-in plays the race at its worst: a request arriving on a
    connection idle for longer than the keep-alive is dropped unanswered."""
    daemon_threads = True

    def __init__(self, keepalive: float):
        self.keepalive, self.answered, self.dropped = keepalive, 0, 0
        super().__init__(("127.0.0.1", 0), KeepAliveHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server_address[1]


class KeepAliveHandler(socketserver.StreamRequestHandler):
    def handle(self):
        idle_since = time.monotonic()
        while request_line := self.rfile.readline():
            if time.monotonic() - idle_since > self.server.keepalive:
                self.server.dropped += 1
                return                                      # the board had closed it
            length = 0
            while (line := self.rfile.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            self.rfile.read(length)
            body = b'{"ok": true}'
            self.server.answered += 1     # before the write: the client may read it and look at once
            self.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            idle_since = time.monotonic()


@pytest.fixture(scope="module")
def balancer(tmp_path_factory):
    tool("nginx")
    if not NJS_MODULE.exists():
        message = f"no {NJS_MODULE} (libnginx-mod-http-js, scripts/ci/install_fleet_deps.sh)"
        pytest.fail(message) if os.environ.get("FLEET_REQUIRE_TOOLS") == "1" else pytest.skip(message)
    tmp = tmp_path_factory.mktemp("nginx")
    instances = {"board1/chat": Instance("board1/chat", ["Qwen3-1.7B"]),
                 "board1/embed": Instance("board1/embed", ["emb", "emb-alias"]),
                 "board2/chat": Instance("board2/chat", ["Qwen3-1.7B"]),
                 "board2/big": Instance("board2/big", ["Qwen3-8B"])}
    port = lambda name: instances[name].port  # noqa: E731
    hostvars = {
        "lb": {},
        "board1": {"ansible_host": "127.0.0.1", "appliance_instances": [
            {"name": "chat", "port": port("board1/chat"), "model_name": "Qwen3-1.7B"},
            {"name": "embed", "port": port("board1/embed"), "task": "embed", "served_model_name": "emb,emb-alias"}]},
        "board2": {"ansible_host": "127.0.0.1", "appliance_instances": [
            {"name": "chat", "port": port("board2/chat"), "model_name": "Qwen3-1.7B"},
            {"name": "big", "port": port("board2/big"), "model_name": "Qwen3-8B"}]}}
    groups = {"boards": ["board1", "board2"], "loadbalancer": ["lb"]}
    routes = fleet_routes(groups["boards"], hostvars, 8080)
    listen = free_port()
    common = dict(groups=groups, hostvars=hostvars, loadbalancer_fleet_routes=routes, loadbalancer_listen_port=listen,
                  loadbalancer_route_body_buffer="16k", loadbalancer_target="lb",
                  loadbalancer_down_states={"lb": {}}, loadbalancer_tls_enabled=False)
    conf = tmp / "conf.d"
    (tmp / "njs").mkdir()
    conf.mkdir()
    (tmp / "njs" / "appliance-routes.js").write_text(
        render_role_template("loadbalancer", "appliance-routes.js.j2", **common))
    (conf / "appliance.conf").write_text(render_role_template("loadbalancer", "appliance-site.conf.j2", **common)
                                         .replace("/etc/nginx/njs/", f"{tmp}/njs/"))
    (conf / "appliance-upstreams.conf").write_text(render_role_template("loadbalancer", "upstreams.conf.j2", **common))
    proc, base = start_nginx(tmp, conf)
    yield base, routes
    proc.terminate()
    proc.wait(timeout=10)
    for server in instances.values():
        server.shutdown()


def start_nginx(tmp: Path, conf: Path, njs: bool = True) -> tuple[subprocess.Popen, str]:
    """Debian's nginx on the rendered site and upstreams in conf/, answering on the site's
    port: (its process, its base URL)."""
    nginx = tool("nginx")
    os.chmod(tmp, 0o755)
    (tmp / "nginx.conf").write_text(f"""
{f'load_module {NJS_MODULE};' if njs else ''}
{'user root;' if os.geteuid() == 0 else ''}
worker_processes 1;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    include {conf}/*.conf;
}}
""")
    argv = [nginx, "-p", tmp, "-e", tmp / "error.log", "-c", tmp / "nginx.conf"]
    check = subprocess.run(argv + ["-t"], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen(argv + ["-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    listen = re.search(r"listen (\d+) default_server", (conf / "appliance.conf").read_text()).group(1)
    base = f"http://127.0.0.1:{listen}"
    deadline = time.monotonic() + 10
    while True:
        try:
            urllib.request.urlopen(base + "/nginx_status", timeout=1)
            return proc, base
        except OSError:
            assert time.monotonic() < deadline and proc.poll() is None, (tmp / "error.log").read_text()
            time.sleep(0.1)


def fleet_routes(boards: list[str], hostvars: dict, backend_port: int) -> dict:
    """The role's loadbalancer_routes filter, called as the templates' variables compute it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "lb_routes", Path(__file__).resolve().parents[2] / "ansible/roles/loadbalancer/filter_plugins/routes.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.routes(boards, hostvars, backend_port)


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(base: str, path: str, body=None, headers=None) -> tuple[int, bytes]:
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(base + path, data=data, method="POST" if data is not None else "GET",
                                 headers={"Content-Type": "application/json", "Authorization": KEY, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def served_by(base: str, path: str, body, headers=None) -> dict:
    code, raw = call(base, path, body, headers)
    assert code == 200, raw[:300]
    return json.loads(raw)


def test_requests_go_to_the_instances_serving_their_model_else_their_paths_task(balancer):
    base, routes = balancer
    assert routes["by_model"] and routes["models"]["emb-alias"] == "appliance_embed"
    assert served_by(base, "/v1/embeddings", {"model": "emb", "input": "x"})["by"] == "board1/embed"
    assert served_by(base, "/v1/embeddings", {"input": "no model named"})["by"] == "board1/embed"
    assert served_by(base, "/v1/chat/completions", {"model": "emb-alias"})["by"] == "board1/embed", \
        "a request naming a model goes to it whatever its path (the instance then refuses the task)"
    assert served_by(base, "/v1/completions", {"model": "Qwen3-8B", "prompt": "p"})["by"] == "board2/big"
    chat = {served_by(base, "/v1/chat/completions", {"model": "Qwen3-1.7B"}, {"X-Session-Id": f"s{n}"})["by"]
            for n in range(12)}
    assert chat == {"board1/chat", "board2/chat"}, "chat sessions spread over both boards' chat instances"
    assert served_by(base, "/v1/chat/completions", {"model": "not-served"})["by"] in CHAT


def test_the_body_arrives_whole_and_a_large_one_is_routed_by_its_path(balancer):
    base, _ = balancer
    body = json.dumps({"model": "Qwen3-8B", "prompt": "word " * 2000}).encode()    # beyond the 16k route buffer
    got = served_by(base, "/v1/completions", body)
    assert got["bytes"] == len(body) and got["by"] in CHAT
    small = json.dumps({"model": "Qwen3-8B", "prompt": "word " * 500}).encode()
    got = served_by(base, "/v1/completions", small)
    assert (got["by"], got["bytes"], got["path"]) == ("board2/big", len(small), "/v1/completions")


def test_a_session_stays_on_one_instance(balancer):
    base, _ = balancer
    for session in ("alpha", "beta", "gamma"):
        seen = {served_by(base, "/v1/chat/completions", {"model": "Qwen3-1.7B"}, {"X-Session-Id": session})["by"]
                for _ in range(5)}
        assert len(seen) == 1, f"{session} went to {seen}"


def test_models_lists_every_instances_models_once_and_needs_the_key(balancer):
    base, _ = balancer
    code, raw = call(base, "/v1/models")
    assert code == 200, raw[:300]
    ids = [m["id"] for m in json.loads(raw)["data"]]
    assert sorted(ids) == ["Qwen3-1.7B", "Qwen3-8B", "emb", "emb-alias"]
    code, raw = call(base, "/v1/models", headers={"Authorization": ""})
    assert code == 401 and b"missing API key" in raw


def test_a_stream_passes_through_the_router(balancer):
    base, _ = balancer
    code, raw = call(base, "/v1/chat/completions", {"model": "Qwen3-8B", "stream": True})
    events = [json.loads(line[len(b"data: "):]) for line in raw.splitlines() if line.startswith(b"data: ")]
    assert code == 200 and [e["n"] for e in events] == [0, 1, 2] and {e["by"] for e in events} == {"board2/big"}


def test_the_balancer_closes_an_idle_connection_before_the_board_does(tmp_path):
    """One board in rotation (the other drained, as in a rollout with a board unreachable): a
    request after a pause longer than the board's keep-alive must not go out on a connection
    the board has closed, because there is no other board to retry on (nginx would answer 502)."""
    tool("nginx")
    from appliance.config import Settings
    from appliance.server.gunicorn import gunicorn_options
    board = KeepAliveBoard(gunicorn_options(Settings())["keepalive"])
    hostvars = {"lb": {}, "board1": {"ansible_host": "127.0.0.2"}, "board2": {"ansible_host": "127.0.0.1"}}
    groups = {"boards": ["board1", "board2"], "loadbalancer": ["lb"]}
    common = dict(groups=groups, hostvars=hostvars, loadbalancer_backend_port=board.port,
                  loadbalancer_fleet_routes=fleet_routes(groups["boards"], hostvars, board.port),
                  loadbalancer_listen_port=free_port(), loadbalancer_target="lb",
                  loadbalancer_down_states={"lb": {"board1": {"by": "rollout"}}}, loadbalancer_tls_enabled=False)
    conf = tmp_path / "conf.d"
    conf.mkdir()
    (conf / "appliance.conf").write_text(render_role_template("loadbalancer", "appliance-site.conf.j2", **common))
    upstreams = render_role_template("loadbalancer", "upstreams.conf.j2", **common)
    assert " down;  # board1" in upstreams, upstreams
    (conf / "appliance-upstreams.conf").write_text(upstreams)
    proc, base = start_nginx(tmp_path, conf, njs=False)
    try:
        assert call(base, "/v1/completions", {"prompt": "p"})[0] == 200
        time.sleep(board.keepalive + 0.5)
        code, raw = call(base, "/v1/completions", {"prompt": "p"})
        assert code == 200 and board.dropped == 0, \
            f"{code} {raw[:120]!r}: the balancer sent a request on a connection the board had closed"
        assert board.answered == 2
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        board.shutdown()
