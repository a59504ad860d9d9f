"""The simulated fleet the lab tests share: 3 boards, a monitoring host and a load balancer,
each a systemd-nspawn container booting its own systemd in its own network namespace
(scripts/lab/lab_up.sh), driven by ansible-playbook over real ssh from a controller
namespace. One bring-up per test session (the `lab` fixture in conftest.py)."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
from pathlib import Path

import pytest
import yaml

from conftest import ANSIBLE_DIR, REPO, VENV_BIN, tool

LAB_DIR = Path(os.environ.get("FLEET_LAB_DIR", "/tmp/fleet-lab"))
CTL = "flab-ctl"
BOARDS = ["board1", "board2", "board3"]
HOSTS = BOARDS + ["mon", "lb"]
LB = "http://10.78.0.3"
PROM = "http://10.78.0.2:9090"
ALERTMANAGER = "http://10.78.0.2:9093"
API_KEY = yaml.safe_load((ANSIBLE_DIR / "inventories/lab/group_vars/boards.yml").read_text())["appliance_api_key"]
UPGRADE_SUFFIX = "+fleetlab2"
BROKEN_SUFFIX = "+fleetlab3"
LOCK_FILE = "/run/lock/appliance-fleet-lab.lock"
LAB_CTL = REPO / "scripts/lab/lab_ctl.sh"             # runs in the controller namespace, CPU accounted
VAULT_PASSWORD_FILE = ANSIBLE_DIR / "inventories/lab/vault-password"     # the lab's vault (not a secret)
STEPS: dict[str, bool] = {}

# A release whose selftest passes but whose server never becomes ready: `appliance serve`
# hangs before it listens (as a model load that never finishes would).
BROKEN_SERVE = '''
# fleet lab: a broken release (the selftest passes, the server never becomes ready)
import sys as _sys
import time as _time
if _sys.argv[1:2] == ["serve"]:
    _time.sleep(3600)
'''


def need(step: str) -> None:
    if not STEPS.get(step):
        pytest.skip(f"needs the earlier step {step!r}")


def snapshot_source(dest: Path, version_suffix: str = "", broken: bool = False) -> Path:
    """The source as the role ships it, frozen for this run (others may edit the tree)."""
    include = yaml.safe_load((ANSIBLE_DIR / "roles/appliance/defaults/main.yml").read_text())["appliance_source_include"]
    dest.mkdir(parents=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc", "build", "*.egg-info")
    for entry in include:
        src = REPO / entry
        if src.is_dir():
            shutil.copytree(src, dest / entry, ignore=ignore)
        elif src.is_file():
            shutil.copy2(src, dest / entry)
    if version_suffix:
        pyproject = dest / "pyproject.toml"
        text, n = re.subn(r'(?m)^(version\s*=\s*")([^"]+)(")', rf"\g<1>\g<2>{version_suffix}\g<3>", pyproject.read_text())
        assert n == 1, "pyproject.toml has no static version to bump for the upgrade"
        pyproject.write_text(text)
    if broken:
        with open(dest / "appliance" / "__init__.py", "a", encoding="utf-8") as f:
            f.write(BROKEN_SERVE)
    return dest


def recap(output: str) -> dict[str, dict[str, int]]:
    hosts = {}
    for m in re.finditer(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", output, re.M):
        hosts[m.group(1)] = {"ok": int(m.group(2)), "changed": int(m.group(3)),
                             "unreachable": int(m.group(4)), "failed": int(m.group(5))}
    return hosts


class Lab:
    def __init__(self, root: Path):
        self.root = root
        self.logs = root / "logs"
        self.logs.mkdir(exist_ok=True)
        self.count = 0

    def ns(self, argv, timeout=60, **kw) -> subprocess.CompletedProcess:
        """Run a command in the controller namespace (the only way into the lab network)."""
        return subprocess.run(["ip", "netns", "exec", CTL, *map(str, argv)], capture_output=True, text=True,
                              timeout=timeout, **kw)

    def on(self, host: str, *argv, check=True, timeout=60) -> str:
        """Run a command inside a host (its own namespaces; scripts/lab/lab_exec.sh)."""
        proc = subprocess.run([REPO / "scripts/lab/lab_exec.sh", host, *map(str, argv)], capture_output=True,
                              text=True, timeout=timeout, env=dict(os.environ, FLEET_LAB_DIR=str(LAB_DIR)))
        if check:
            assert proc.returncode == 0, f"{host}: {' '.join(map(str, argv))}: {proc.stdout}{proc.stderr}"
        return proc.stdout

    def cut_off(self, host: str, up: bool = False) -> None:
        """Take a host's network down (it stops answering anyone) or bring it back; Ansible's
        ssh connections are closed so that the next play sees the host as it is."""
        subprocess.run(["ip", "-n", f"flab-{host}", "link", "set", "eth0", "up" if up else "down"], check=True)
        for sock in (self.root / "cp").iterdir():
            subprocess.run(["ssh", "-O", "exit", "-o", f"ControlPath={sock}", "lab-host"], capture_output=True,
                           timeout=30)

    def unit(self, host: str, unit: str, *props: str) -> dict[str, str]:
        out = self.on(host, "systemctl", "show", unit, *[f"--property={p}" for p in props])
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def playbook(self, name: str, *extra: str, inventories=(), timeout=900) -> tuple[int, str]:
        """ansible-playbook NAME in the controller namespace, with the lab's rollout settings;
        the log gets timestamps (where does the time go?)."""
        self.count += 1
        log = self.logs / f"{self.count:02d}-{name.replace('.yml', '')}.log"
        env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", ANSIBLE_FORCE_COLOR="0",
                   ANSIBLE_NOCOLOR="1", ANSIBLE_VAULT_PASSWORD_FILE=str(VAULT_PASSWORD_FILE))
        argv = [LAB_CTL, VENV_BIN / "ansible-playbook", "-i", "inventories/lab/hosts.yml"]
        for inventory in inventories:
            argv += ["-i", inventory]
        argv += [name, "-e", "@inventories/lab/rollout.yml", *extra]
        t0 = time.monotonic()
        proc = subprocess.Popen(argv, cwd=ANSIBLE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        lines = []
        with open(log, "w", encoding="utf-8") as f:
            for line in proc.stdout:
                lines.append(line)
                f.write(f"[{time.monotonic() - t0:6.1f}s] {line}")
        rc = proc.wait()
        timer.cancel()
        print(f"{name} {' '.join(extra)}: rc={rc} in {time.monotonic() - t0:.0f} s (log {log})")
        return rc, "".join(lines)

    def get(self, url: str, headers: dict | None = None) -> tuple[int, str]:
        argv = ["curl", "-s", "-m", "10", "-w", "\n%{http_code}"]
        for k, v in (headers or {}).items():
            argv += ["-H", f"{k}: {v}"]
        proc = self.ns(argv + [url])
        body, _, code = proc.stdout.rpartition("\n")
        return int(code or 0), body

    def query(self, promql: str) -> list[dict]:
        code, body = self.get(f"{PROM}/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert code == 200, f"{promql}: HTTP {code} {body[:300]}"
        return json.loads(body)["data"]["result"]

    def alertmanager_alerts(self) -> list[dict]:
        code, body = self.get(f"{ALERTMANAGER}/api/v2/alerts")
        assert code == 200, body[:300]
        return json.loads(body)

    def notifications(self, receiver: str) -> list[dict]:
        """What Alertmanager delivered to a receiver (scripts/lab/webhook_receiver.py)."""
        path = self.root / "webhook" / f"{receiver}.jsonl"
        return [json.loads(line)["payload"] for line in path.read_text().splitlines()] if path.exists() else []

    def board_version(self, board: str) -> str:
        code, metrics = self.get(f"{LB}/boards/{board}/metrics")
        versions = re.findall(r'appliance_build_info\{[^}]*version="([^"]+)"', metrics)
        assert code == 200 and versions, f"{board}: /metrics {code}"
        return versions[0]

    @staticmethod
    def wait_for(what: str, check, timeout: float, every: float = 2.0):
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value or time.monotonic() > deadline:
                assert value, f"timed out after {timeout:.0f} s waiting for {what}"
                return value
            time.sleep(every)

    def client_loop(self, name: str, max_seconds: float, pause: float = 0.5, max_tokens: int = 200,
                    workers: int = 2, api_key: str = API_KEY):
        out, stop = self.root / f"{name}.json", self.root / f"{name}.stop"
        proc = subprocess.Popen([LAB_CTL, sys.executable, REPO / "scripts/lab/client_loop.py", LB,
                                 "--api-key", api_key, "--out", out, "--stop-file", stop, "--max-tokens",
                                 str(max_tokens), "--workers", str(workers), "--max-seconds", str(max_seconds),
                                 "--pause", str(pause)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return proc, out, stop

    def playbook_under_load(self, client: str, name: str, *extra: str, inventories=()) -> tuple[int, str, dict]:
        """A playbook run while a client loop keeps requesting through the balancer: (rc, output,
        the loop's stats)."""
        loop = self.client_loop(client, max_seconds=900)
        try:
            rc, out = self.playbook(name, *extra, inventories=inventories)
        finally:
            stats = self.finish(loop)
        return rc, out, stats

    @staticmethod
    def finish(loop) -> dict:
        proc, out, stop = loop
        stop.touch()
        proc.wait(timeout=180)
        stats = json.loads(out.read_text())
        print(f"client loop: {stats['ok']} ok ({stats['streams']} streams of {stats['max_tokens']} tokens, "
              f"longest {stats['longest_s']} s), {stats['failed']} failed, {stats['cut']} cut in {stats['seconds']} s")
        return stats


def board_file(board: str, path: str) -> Path:
    """A file of a host as its copy-on-write layer stores it (written by that host)."""
    return LAB_DIR / "hosts" / board / "upper" / path.lstrip("/")


def queue_for_the_lab():
    """One lab per machine: wait for another run's lock (test_fleet.sh holds it already)."""
    if os.environ.get("FLEET_LAB_LOCK_HELD") == "1":
        return None
    os.makedirs(os.path.dirname(LOCK_FILE), exist_ok=True)
    lock = open(LOCK_FILE, "w")
    deadline = time.monotonic() + 1200
    while True:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return lock
        except BlockingIOError:
            if time.monotonic() > deadline:
                pytest.fail(f"another fleet run held {LOCK_FILE} for 20 minutes")
            time.sleep(5)


def bring_up():
    """Yields a Lab with the three source snapshots; always tears it down (FLEET_LAB_KEEP=1 keeps it)."""
    if os.geteuid() != 0:
        message = "the lab needs root (namespaces, mounts, cgroups)"
        if os.environ.get("FLEET_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    for name in ("ip", "systemd-nspawn", "nsenter", "ssh", "prometheus", "ansible-playbook", "curl"):
        tool(name)
    lock = queue_for_the_lab()
    if subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("flab-"):
        # we hold the lock, so nobody owns this lab: a run that died left it
        subprocess.run([REPO / "scripts/lab/lab_down.sh"], capture_output=True, timeout=300)
    wheelhouse = os.environ.get("FLEET_WHEELHOUSE", "/var/cache/appliance-fleet/wheelhouse")
    rootfs = os.environ.get("FLEET_ROOTFS", "/var/cache/appliance-fleet/rootfs")
    apt_repo = os.environ.get("FLEET_APT_REPO", "/var/cache/appliance-fleet/apt-repo")
    # The tests download nothing: both come from scripts/ci/install_fleet_deps.sh.
    for check in ([REPO / "scripts/lab/build_wheelhouse.sh", wheelhouse, "--check"],
                  [REPO / "scripts/lab/build_rootfs.sh", rootfs, "--check"],
                  [REPO / "scripts/lab/build_apt_repo.sh", apt_repo, "--check"]):
        fresh = subprocess.run(check, capture_output=True, text=True)
        assert fresh.returncode == 0, fresh.stderr
    if LAB_DIR.exists() and not os.path.ismount(LAB_DIR):
        shutil.rmtree(LAB_DIR)
    env = dict(os.environ, FLEET_LAB_DIR=str(LAB_DIR), FLEET_WHEELHOUSE=wheelhouse, FLEET_ROOTFS=rootfs,
               FLEET_APT_REPO=apt_repo)
    try:
        t0 = time.monotonic()
        up = subprocess.run([REPO / "scripts/lab/lab_up.sh", str(len(BOARDS))], env=env, capture_output=True,
                            text=True, timeout=300)
        assert up.returncode == 0, up.stdout + up.stderr
        print(f"lab up in {time.monotonic() - t0:.0f} s")
        snapshot_source(LAB_DIR / "src-v1")
        snapshot_source(LAB_DIR / "src-v2", UPGRADE_SUFFIX)
        snapshot_source(LAB_DIR / "src-v3", BROKEN_SUFFIX, broken=True)
        lab = Lab(LAB_DIR)
        yield lab
    finally:
        for host in HOSTS:                  # every host's journal goes with the playbook logs
            journal = subprocess.run([REPO / "scripts/lab/lab_exec.sh", host, "journalctl", "-b", "--no-pager",
                                      "-o", "short-precise"], capture_output=True, text=True, timeout=60,
                                     env=dict(os.environ, FLEET_LAB_DIR=str(LAB_DIR)))
            if (LAB_DIR / "logs").exists() and journal.returncode == 0:
                (LAB_DIR / "logs" / f"journal-{host}.txt").write_text(journal.stdout)
        if os.environ.get("FLEET_LAB_KEEP") == "1":
            print(f"FLEET_LAB_KEEP=1: the lab stays up in {LAB_DIR}")
        else:
            logs = Path(os.environ.get("FLEET_LAB_LOGS", "/tmp/fleet-lab-logs"))
            if (LAB_DIR / "logs").exists():
                shutil.rmtree(logs, ignore_errors=True)
                shutil.copytree(LAB_DIR / "logs", logs)
            down = subprocess.run([REPO / "scripts/lab/lab_down.sh"], env=env, timeout=300, capture_output=True,
                                  text=True)
            print(down.stdout + down.stderr)
            if logs.exists():
                (logs / "lab_down.txt").write_text(down.stdout + down.stderr)
        if lock is not None:
            lock.close()
