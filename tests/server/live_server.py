"""Start and drive a real `python -m appliance serve` (gunicorn) process for tests.

Imported by name (`from live_server import ...`): a unique module name, unlike conftest.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "lab"))
from fake_sysfs import make_tree  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = Path(os.environ.get("APPLIANCE_TEST_ARTIFACTS", REPO / "artifacts"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, proc: subprocess.Popen, port: int, workdir: Path, log_path: Path, api_key: str | None):
        self.proc = proc
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.workdir = workdir
        self.log_path = log_path
        self.api_key = api_key
        self.http = requests.Session()
        if api_key:
            self.http.headers["Authorization"] = f"Bearer {api_key}"

    def get(self, path: str, **kw):
        kw.setdefault("timeout", 30)
        return self.http.get(self.base + path, **kw)

    def post(self, path: str, **kw):
        kw.setdefault("timeout", 60)
        return self.http.post(self.base + path, **kw)

    def health(self) -> dict:
        return requests.get(self.base + "/health", timeout=10).json()

    def metrics(self) -> dict[tuple, float]:
        """{(sample name, sorted label items): value} from one scrape."""
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(self.base + "/metrics", timeout=10).text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def wait_idle(self, timeout: float = 20.0) -> dict:
        """Until nothing runs or waits and every KV block is free (bounded)."""
        deadline = time.monotonic() + timeout
        while True:
            q = self.health().get("queue", {})
            if q.get("running") == 0 and q.get("waiting") == 0 and q.get("kv_blocks_used") == 0:
                return q
            if time.monotonic() > deadline:
                raise AssertionError(f"server not idle after {timeout} s: {q}")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def start_server(model_dir: Path | None, *args: str, api_key: str | None = None, env: dict | None = None,
                 layout: str = "vendor", wait: bool = True) -> LiveServer:
    # a short directory: unix socket paths must stay under 108 bytes
    workdir = Path(tempfile.mkdtemp(prefix="apl-"))
    sysfs = make_tree(workdir / "sys", layout)
    port = free_port()
    cmd = [sys.executable, "-m", "appliance", "serve", "--port", str(port),
           "--control-socket", str(workdir / "gunicorn.ctl"), *args]
    if model_dir is not None:
        cmd += ["--model", str(model_dir)]
    if api_key:
        cmd += ["--api-key", api_key]
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_")}
    full_env.update({"APPLIANCE_SYSFS_ROOT": str(sysfs), "APPLIANCE_THERMAL_INTERVAL": "0.5",
                     "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HOME": str(workdir)})
    full_env.update(env or {})
    log_path = workdir / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env, cwd=str(REPO),
                                start_new_session=True)
    server = LiveServer(proc, port, workdir, log_path, api_key)
    if wait:
        wait_ready(server)
    return server


@contextlib.contextmanager
def serving(model_dir: Path | None, *args: str, **kw):
    """start_server(...) for a `with` block or a fixture's yield: stopped and cleaned up after, and a
    server that did not exit cleanly (code != 0) fails the test with its log's tail."""
    srv = start_server(model_dir, *args, **kw)
    try:
        yield srv
    finally:
        code = srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)
        assert code == 0, srv.log()[-3000:]


def wait_ready(server: LiveServer, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()}")
        try:
            if requests.get(server.base + "/health", timeout=5).status_code == 200:
                return
        except (requests.ConnectionError, requests.Timeout):    # not up yet, or a busy machine
            pass
        time.sleep(0.1)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server not ready after {timeout} s:\n{server.log()}")
