"""A newcomer's `make run` (README, "Start"): a second run rebuilds nothing and serves at once,
printing only the server's own few lines; a changed kernel source, and only that, rebuilds.

- A fresh clone (slow: a virtualenv from PyPI and one kernel build): `make run` twice, the
  first quiet and building the kernels once, the second serving without building anything.
- This checkout, whose stamps the suite's own set-up (`make test` builds first) has just
  brought up to date: `make run` serves without touching a stamp or the compiled kernels.
- What make would do after an edit is asked of make itself with `make -n -W FILE` (as if
  FILE had just changed), so that no test rebuilds the kernels under the suite using them.
"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

REPO = Path(__file__).resolve().parents[1]
VENV = Path(sys.prefix)
STAMPS = (".run-stamp", ".editable-stamp", ".build-stamp")
# What a rebuild or an install would print (make's own lines, pip's, setuptools', the compiler's).
NOISE = re.compile(r"setting up|installing|building|build_ext|Package would be ignored|"
                   r"setuptools|Cython|gcc|warning:", re.IGNORECASE)

pytestmark = pytest.mark.skipif(not all((VENV / s).exists() for s in STAMPS) or VENV.resolve() != (REPO / ".venv").resolve(),
                                reason="make run's stamps live in the checkout's .venv: run `make build` first")


def make(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", "-C", str(REPO), *args], capture_output=True, text=True,
                          env=env or os.environ, timeout=60, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_kernels_are_up_to_date_with_their_sources():
    """The precondition of everything below, said plainly when it fails."""
    r = make("-q", "build")
    assert r.returncode == 0, ("kernel sources changed since the last build: `make build` rebuilds them "
                               f"({r.stdout}{r.stderr})")


def dry_run(*changed: str) -> str:
    """The commands `make run` would execute if `changed` had just been edited."""
    r = make("-n", *[a for f in changed for a in ("-W", f)], "run", f"PORT={free_port()}")
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_make_run_with_nothing_changed_only_serves():
    out = dry_run()
    assert "appliance serve" in out
    assert "pip" not in out and "build_ext" not in out, out


@pytest.mark.parametrize("source", ["kernels/kernels.h", "kernels/portable.c", "kernels/kernels.pyx",
                                    "kernels/arm/neon.c", "setup.py"])
def test_a_changed_kernel_source_rebuilds_the_kernels_only(source):
    out = dry_run(source)
    assert "setup.py -q build_ext --inplace --force" in out, out
    assert "pip" not in out, out                    # the environment is left as it is
    assert out.rstrip().splitlines()[-1].lstrip("@").startswith(".venv/bin/appliance serve"), out


def test_a_changed_pyproject_reinstalls_the_runtime_only():
    out = dry_run("pyproject.toml")
    assert "install --no-build-isolation -e ." in out, out
    # pip's editable install compiles the kernels; the build step after it looks before it builds again
    assert "-newer .venv/.editable-stamp" in out, out
    assert "requirements-test.txt" not in out, out   # the test stack is make test's alone


def make_run(checkout: Path, home: Path, timeout: float) -> tuple[float, list[str]]:
    """`make run` until /health answers 200, then SIGTERM: (seconds it took, lines printed)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("APPLIANCE_", "MAKE", "VIRTUAL_ENV", "PYTHON", "PIP_"))}
    env.update({"HOME": str(home), "OMP_NUM_THREADS": "1",        # gunicorn's control socket goes to HOME
                "PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR", str(Path.home() / ".cache" / "pip")),
                "PATH": os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                                        if Path(p).resolve() != (VENV / "bin").resolve())})
    log_path = home / f"make-run-{port}.log"
    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(["make", "--no-print-directory", "-C", str(checkout), "run", f"PORT={port}"],
                                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        ready_after = None
        while time.monotonic() < t0 + timeout and proc.poll() is None:
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    ready_after = time.monotonic() - t0
                    break
            except requests.RequestException:          # not listening yet, or busy loading
                pass
            time.sleep(0.1)
        time.sleep(0.3)                                  # the ready line follows /health by a moment
        output = log_path.read_text(errors="replace")
        assert ready_after is not None, output
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    lines = [line for line in output.splitlines() if line.strip()]
    print(f"make run in {checkout}: serving after {ready_after:.1f} s, {len(lines)} lines")
    return ready_after, lines


def assert_serving_quietly(lines: list[str]) -> None:
    output = "\n".join(lines)
    assert not [line for line in lines if NOISE.search(line)], output
    assert any("dashboard and API at http://127.0.0.1:" in line for line in lines), output
    ready = next((i for i, line in enumerate(lines) if "serving demo_model" in line), None)
    assert ready is not None, output
    # up to the ready line: gunicorn's start, the address, the KV pool, the selftest, the ready line
    # (the access log's lines for this test's own /health polls aside)
    start = [line for line in lines[:ready + 1] if "appliance.access: GET /health" not in line]
    assert len(start) <= 10, output


def test_second_make_run_serves_at_once_and_quietly(tmp_path):
    before = {s: (VENV / s).stat().st_mtime_ns for s in STAMPS}
    kernels = sorted((REPO / "appliance" / "kernels").glob("_kernels*.so"))
    built = [k.stat().st_mtime_ns for k in kernels]
    seconds, lines = make_run(REPO, tmp_path, timeout=120)
    (tmp_path / "timing.txt").write_text(f"{seconds:.2f} s to /health 200\n" + "\n".join(lines))
    assert_serving_quietly(lines)
    assert {s: (VENV / s).stat().st_mtime_ns for s in STAMPS} == before
    assert [k.stat().st_mtime_ns for k in kernels] == built          # nothing rebuilt


@pytest.mark.slow
def test_fresh_clone_make_run_twice(tmp_path):
    """As a newcomer does it: clone, `make run`, stop, `make run` again (the committed tree)."""
    clone = tmp_path / "appliance"
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True, timeout=120)
    first_s, first = make_run(clone, tmp_path, timeout=900)
    output = "\n".join(first)
    assert first[:2] == ["setting up .venv: build tools",            # make's own lines: two, then the server
                         "installing the appliance and its runtime dependencies, building the kernels "
                         "(log: .venv/install.log)"], output
    assert "building the kernels (their sources changed)" not in output      # built once, by the install
    assert not [line for line in first[2:] if NOISE.search(line)], output
    installed = subprocess.run([str(clone / ".venv/bin/python"), "-m", "pip", "list", "--format=freeze"],
                               capture_output=True, text=True, check=True).stdout.lower()
    for test_only in ("torch==", "transformers==", "playwright==", "ansible-core==", "pytest=="):
        assert test_only not in installed, test_only                     # the runtime only
    kernels = sorted((clone / "appliance" / "kernels").glob("_kernels*.so"))
    assert kernels, "the kernels were not compiled into the clone"
    built = [k.stat().st_mtime_ns for k in kernels]
    second_s, second = make_run(clone, tmp_path, timeout=120)
    (tmp_path / "timing.txt").write_text(f"first make run: {first_s:.1f} s\nsecond make run: {second_s:.1f} s\n")
    assert_serving_quietly(second)
    assert [k.stat().st_mtime_ns for k in kernels] == built
