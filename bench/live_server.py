"""A real `appliance serve` process for benchmarks: start, wait until ready, stop; streamed
requests with the arrival time of every token. Shared by the benchmarks that measure what
clients see (latency between tokens, time to first token)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    def __init__(self, model_dir: Path, *args: str, threads: int | None = None, log_level: str = "info"):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.work = Path(tempfile.mkdtemp(prefix="apl-bench-"))
        cmd = [sys.executable, "-m", "appliance", "serve", "--model", str(model_dir), "--port", str(self.port),
               "--control-socket", str(self.work / "ctl"), "--log-level", log_level, *args]
        if threads:
            cmd += ["--threads", str(threads)]
        self.log_path = self.work / "server.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=str(REPO),
                                     start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
        self._wait_ready()
        self.facts = requests.get(self.base + "/health", timeout=10).json()["model"]
        self.model = self.facts["id"]

    def _wait_ready(self, timeout: float = 1800.0) -> None:       # a first load quantizes the checkpoint
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                if requests.get(self.base + "/health", timeout=5).status_code == 200:
                    return
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not become ready")
            time.sleep(0.5)

    def health(self) -> dict:
        return requests.get(self.base + "/health", timeout=10).json()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def stream(base: str, path: str, body: dict, times: list, stop=None) -> dict:
    """POST a streaming request; appends the arrival time of every chunk that carries a token to
    `times` (as they come, so another thread may read them); stops early when stop() is true.
    Returns the last usage object seen (stream_options.include_usage) or {}."""
    usage = {}
    body = {**body, "stream": True}
    with requests.post(base + path, json=body, stream=True, timeout=(10, 1800)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if stop is not None and stop():
                break
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("error"):
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta")
                carries = choice.get("text") is not None if delta is None else any(
                    delta.get(k) for k in ("content", "reasoning_content", "tool_calls"))
                if carries or choice.get("finish_reason"):
                    times.append(time.perf_counter())
    return usage


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def load_line() -> str:
    return f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs"
