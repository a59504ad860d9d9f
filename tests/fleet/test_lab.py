"""The fleet on simulated boards: 3 boards, a monitoring host and a load balancer, each a
network namespace with its own sshd, hostname, /srv and /etc (scripts/lab/lab_up.sh),
driven by ansible-playbook over real ssh from a controller namespace.

In order: site.yml converges and builds the kernels on every board; every board answers
through the load balancer; a second run changes nothing; Prometheus scrapes every
appliance and node_exporter; rollout.yml upgrades every board while a client loop
through the load balancer sees no failed request; every dashboard query returns data;
a hot sensor on board2 fires the throttling alert for board2 only; bench.yml gathers a
fleet table. Traffic stays inside the lab's namespaces.
"""
from __future__ import annotations

import fcntl
import json
import math
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

from conftest import ANSIBLE_DIR, REPO, VENV_BIN, concrete, dashboard_queries, tool

pytestmark = [pytest.mark.fleet, pytest.mark.slow]

LAB_DIR = Path(os.environ.get("FLEET_LAB_DIR", "/tmp/fleet-lab"))
CTL = "flab-ctl"
BOARDS = ["board1", "board2", "board3"]
LB = "http://10.78.0.3"
PROM = "http://10.78.0.2:9090"
API_KEY = yaml.safe_load((ANSIBLE_DIR / "inventories/lab/group_vars/boards.yml").read_text())["appliance_api_key"]
UPGRADE_SUFFIX = "+fleetlab2"
STEPS: dict[str, bool] = {}
LOCK_FILE = "/run/lock/appliance-fleet-lab.lock"


def need(step: str) -> None:
    if not STEPS.get(step):
        pytest.skip(f"needs the earlier step {step!r}")


def snapshot_source(dest: Path, version_suffix: str = "") -> Path:
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
    return dest


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

    def playbook(self, name: str, *extra: str, timeout=900) -> tuple[int, str]:
        self.count += 1
        log = self.logs / f"{self.count:02d}-{name.replace('.yml', '')}.log"
        env = dict(os.environ, PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", ANSIBLE_FORCE_COLOR="0",
                   ANSIBLE_NOCOLOR="1")
        t0 = time.monotonic()
        proc = subprocess.Popen(["ip", "netns", "exec", CTL, VENV_BIN / "ansible-playbook", "-i",
                                 "inventories/lab/hosts.yml", name, *extra],
                                cwd=ANSIBLE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        lines = []
        with open(log, "w", encoding="utf-8") as f:
            for line in proc.stdout:           # the log gets timestamps: where does the time go?
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

    def wait_for(self, what: str, check, timeout: float, every: float = 2.0):
        deadline = time.monotonic() + timeout
        while True:
            value = check()
            if value or time.monotonic() > deadline:
                assert value, f"timed out after {timeout:.0f} s waiting for {what}"
                return value
            time.sleep(every)

    def client_loop(self, name: str, max_seconds: float, pause: float = 0.15) -> tuple[subprocess.Popen, Path, Path]:
        out, stop = self.root / f"{name}.json", self.root / f"{name}.stop"
        proc = subprocess.Popen(["ip", "netns", "exec", CTL, sys.executable, REPO / "scripts/lab/client_loop.py", LB,
                                 "--api-key", API_KEY, "--out", out, "--stop-file", stop,
                                 "--max-seconds", str(max_seconds), "--pause", str(pause)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        return proc, out, stop

    @staticmethod
    def finish(loop) -> dict:
        proc, out, stop = loop
        stop.touch()
        proc.wait(timeout=120)
        return json.loads(out.read_text())


def recap(output: str) -> dict[str, dict[str, int]]:
    hosts = {}
    for m in re.finditer(r"^(\S+)\s+:\s+ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", output, re.M):
        hosts[m.group(1)] = {"ok": int(m.group(2)), "changed": int(m.group(3)),
                             "unreachable": int(m.group(4)), "failed": int(m.group(5))}
    return hosts


@pytest.fixture(scope="module")
def lab():
    if os.geteuid() != 0:
        message = "the lab needs root (network and mount namespaces)"
        if os.environ.get("FLEET_REQUIRE_TOOLS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    for name in ("ip", "sshd", "nginx", "prometheus", "prometheus-node-exporter", "ansible-playbook", "curl",
                 "systemd-analyze", "gcc"):
        tool(name)
    lock = None
    if os.environ.get("FLEET_LAB_LOCK_HELD") != "1":   # scripts/ci/test_fleet.sh holds it already
        os.makedirs(os.path.dirname(LOCK_FILE), exist_ok=True)
        lock = open(LOCK_FILE, "w")
        deadline = time.monotonic() + 1200
        while True:                                     # one lab per machine: queue behind another run
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another fleet run held {LOCK_FILE} for 20 minutes")
                time.sleep(5)
    if subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.count("flab-"):
        # we hold the lock, so nobody owns this lab: a run that died left it
        subprocess.run([REPO / "scripts/lab/lab_down.sh"], capture_output=True, timeout=300)
    wheelhouse = os.environ.get("FLEET_WHEELHOUSE", "/var/cache/appliance-fleet/wheelhouse")
    # The tests download nothing: the wheelhouse comes from scripts/ci/install_fleet_deps.sh.
    fresh = subprocess.run([REPO / "scripts/lab/build_wheelhouse.sh", wheelhouse, "--check"], capture_output=True,
                           text=True)
    assert fresh.returncode == 0, fresh.stderr
    if LAB_DIR.exists() and not os.path.ismount(LAB_DIR):
        shutil.rmtree(LAB_DIR)
    env = dict(os.environ, FLEET_LAB_DIR=str(LAB_DIR), FLEET_WHEELHOUSE=wheelhouse)
    try:
        up = subprocess.run([REPO / "scripts/lab/lab_up.sh", str(len(BOARDS))], env=env, capture_output=True,
                            text=True, timeout=120)
        assert up.returncode == 0, up.stdout + up.stderr
        snapshot_source(LAB_DIR / "src-v1")
        snapshot_source(LAB_DIR / "src-v2", UPGRADE_SUFFIX)
        yield Lab(LAB_DIR)
    finally:
        keep = os.environ.get("FLEET_LAB_KEEP") == "1"
        if keep:
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


def board_file(board: str, path: str) -> Path:
    """A file of a board's /opt, /etc, /var/... as its overlay stores it (written by that board)."""
    return LAB_DIR / "hosts" / board / "upper" / path.lstrip("/")


def test_site_converges_and_builds_the_kernels_on_every_board(lab):
    rc, out = lab.playbook("site.yml", "-e", f"appliance_source_dir={LAB_DIR / 'src-v1'}")
    assert rc == 0, out[-8000:]
    hosts = recap(out)
    assert set(hosts) == set(BOARDS) | {"mon", "lb"}
    assert all(h["failed"] == 0 and h["unreachable"] == 0 for h in hosts.values()), hosts
    for board in BOARDS:
        built = list(board_file(board, "/opt/appliance/releases").glob(
            "*/venv/lib/python3*/site-packages/appliance/kernels/_kernels*.so"))
        assert len(built) == 1, f"{board}: kernels not built in its own /opt: {built}"
        assert board_file(board, "/etc/systemd/system/appliance.service").is_file()
        governor = LAB_DIR / "hosts" / board / "srv/fake-sysfs/class/devfreq/dmc/governor"
        assert governor.read_text().strip() == "performance", f"{board}: DDR governor not pinned"
    datasource = yaml.safe_load(board_file("mon", "/etc/grafana/provisioning/datasources/fleet.yml").read_text())
    assert datasource["datasources"][0]["url"] == "http://127.0.0.1:9090"
    assert board_file("mon", "/var/lib/grafana/dashboards/fleet/fleet.json").is_file()
    STEPS["site"] = True


def test_every_board_answers_through_the_load_balancer(lab):
    need("site")
    for board in BOARDS:
        code, body = lab.get(f"{LB}/boards/{board}/health")
        assert code == 200, f"{board}: /health {code} {body[:300]}"
        assert json.loads(body)["status"] == "ready"
    code, body = lab.get(f"{LB}/v1/models", {"Authorization": f"Bearer {API_KEY}"})
    assert code == 200 and json.loads(body)["data"], body[:300]
    code, _ = lab.get(f"{LB}/v1/models")
    assert code == 401, "the API key from the settings file is not enforced"


def test_a_second_site_run_changes_nothing(lab):
    need("site")
    rc, out = lab.playbook("site.yml", "-e", f"appliance_source_dir={LAB_DIR / 'src-v1'}")
    assert rc == 0, out[-8000:]
    hosts = recap(out)
    changed = {h: v["changed"] for h, v in hosts.items() if v["changed"]}
    assert not changed, f"not idempotent: {changed}\n" + "\n".join(
        l for l in out.splitlines() if l.startswith("changed:") or l.startswith("TASK"))[-6000:]
    STEPS["idempotent"] = True


def test_prometheus_scrapes_every_appliance_and_node_exporter(lab):
    need("site")
    expected = {("appliance", b) for b in BOARDS} | {("node", h) for h in BOARDS + ["mon", "lb"]}

    def up():
        got = {(r["metric"]["job"], r["metric"]["instance"]) for r in lab.query("up == 1")}
        return expected <= got

    lab.wait_for("every target up", up, timeout=60)
    temps = lab.query('node_thermal_zone_temp{board="board1"}')
    assert len(temps) == 7, "board1's node_exporter does not read its fake RK3588 sysfs"
    promtool = tool("promtool")
    code, metrics = lab.get(f"{LB}/boards/board1/metrics")
    assert code == 200
    check = subprocess.run([promtool, "check", "metrics"], input=metrics, capture_output=True, text=True)
    problems = [l for l in (check.stdout + check.stderr).splitlines() if l.strip()]
    print("promtool check metrics:", problems or "clean")
    assert "error" not in (check.stdout + check.stderr).lower(), problems
    STEPS["prometheus"] = True


def test_rollout_upgrades_every_board_without_a_failed_request(lab):
    need("site")
    loop = lab.client_loop("rollout-client", max_seconds=600)
    try:
        time.sleep(3)
        rc, out = lab.playbook("rollout.yml", "-e", f"appliance_source_dir={LAB_DIR / 'src-v2'}")
    finally:
        stats = lab.finish(loop)
    assert rc == 0, out[-8000:]
    print(f"client loop during the rollout: {stats['ok']} ok, {stats['failed']} failed in {stats['seconds']} s")
    assert stats["failed"] == 0, stats["errors"][:20]
    assert stats["ok"] >= 50, stats
    batches = re.findall(r"Take the batch out of the load balancer", out)
    assert len(batches) == len(BOARDS), "expected one batch per board"
    for board in BOARDS:
        code, metrics = lab.get(f"{LB}/boards/{board}/metrics")
        versions = re.findall(r'appliance_build_info\{[^}]*version="([^"]+)"', metrics)
        assert versions and versions[0].endswith(UPGRADE_SUFFIX), f"{board} runs {versions}"
        releases = [p for p in board_file(board, "/opt/appliance/releases").iterdir() if p.is_dir()]
        assert len(releases) == 2, f"{board}: releases {releases}"
    upstreams = board_file("lb", "/etc/nginx/conf.d/appliance-upstreams.conf").read_text()
    assert " down;" not in upstreams, "a board was left out of the load balancer"
    STEPS["rollout"] = True


def test_every_dashboard_query_returns_data(lab):
    need("prometheus")
    loop = lab.client_loop("dashboard-client", max_seconds=120, pause=0.2)
    try:
        empty = {}
        deadline = time.monotonic() + 60
        for title, expr in dashboard_queries(annotations=False):  # panels; the alert annotation may be empty
            while True:
                result = lab.query(concrete(expr))
                values = [float(r["value"][1]) for r in result]
                if any(math.isfinite(v) for v in values):
                    break
                if time.monotonic() > deadline:
                    empty[title] = (concrete(expr), values)
                    break
                time.sleep(2)
    finally:
        lab.finish(loop)
    assert not empty, f"queries without data: {json.dumps(empty, indent=1)}"


def test_a_hot_sensor_fires_the_throttling_alert_for_that_board_only(lab):
    need("prometheus")
    fake = REPO / "scripts/lab/fake_sysfs.py"
    subprocess.run([sys.executable, fake, "heat", LAB_DIR / "hosts/board2/srv/fake-sysfs"], check=True)
    try:
        def firing():
            alerts = lab.query('ALERTS{alertname="BoardThermalThrottling"}')
            states = {(a["metric"]["board"], a["metric"]["alertstate"]) for a in alerts}
            return states if ("board2", "firing") in states else None

        states = lab.wait_for("BoardThermalThrottling firing for board2", firing, timeout=90)
        assert states == {("board2", "firing")}, f"other boards alerted too: {states}"
        assert lab.query('board:cpu_throttled:max{board=~"board1|board3"} > 0') == []
    finally:
        subprocess.run([sys.executable, fake, "cool", LAB_DIR / "hosts/board2/srv/fake-sysfs"], check=True)


def test_bench_gathers_one_fleet_table(lab):
    need("site")
    out_dir = LAB_DIR / "bench"
    rc, out = lab.playbook("bench.yml", "-e", "fleet_bench_context=32", "-e", "fleet_bench_gen=4",
                           "-e", f"fleet_bench_output_dir={out_dir}")
    assert rc == 0, out[-6000:]
    table = (out_dir / "fleet-bench.md").read_text()
    for board in BOARDS:
        assert re.search(rf"^\| 32 \| {board} \| exact \| [0-9.]+ \|", table, re.M), table
