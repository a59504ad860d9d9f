"""Static checks of monitoring/: promtool on config, rules and rule tests; every alert's
labels and runbook section; the dashboard's structure and every one of its queries; metric
names against the server's exporter; Alertmanager's inhibition with the real binary."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from conftest import DASHBOARD, MONITORING, REPO, concrete, dashboard_queries, run, tool

PROM = MONITORING / "prometheus"
RULE_FILES = sorted((PROM / "rules").glob("*.yml"))
TEST_FILES = sorted((PROM / "tests").glob("*.yml"))


def test_promtool_checks_the_example_config_and_its_rules():
    promtool = tool("promtool")
    run([promtool, "check", "config", "prometheus.example.yml"], cwd=PROM)


def test_promtool_checks_the_rules():
    promtool = tool("promtool")
    run([promtool, "check", "rules", *RULE_FILES], cwd=PROM)


def test_promtool_rule_tests_pass():
    promtool = tool("promtool")
    proc = run([promtool, "test", "rules", *TEST_FILES], cwd=PROM)
    assert "SUCCESS" in proc.stdout


def test_every_alert_has_a_firing_and_a_quiet_case():
    """Each alert is tested; in every test with a firing alert some input board stays quiet
    (the Watchdog has no quiet case: it fires all the time)."""
    alerts = {r["alert"] for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]
              for r in g["rules"] if "alert" in r}
    fired, quiet = set(), set()
    for f in TEST_FILES:
        for case in yaml.safe_load(f.read_text())["tests"]:
            inputs = {m.group(1) for s in case.get("input_series", [])
                      for m in [re.search(r'(?:board|instance)="([^"]+)"', s["series"])] if m}
            for check in case.get("alert_rule_test", []):
                exp = check.get("exp_alerts") or []
                names = {a["exp_labels"].get("board", a["exp_labels"].get("instance")) for a in exp}
                if exp:
                    fired.add(check["alertname"])
                if not exp or inputs - names:
                    quiet.add(check["alertname"])
    assert alerts <= fired, f"alerts never tested firing: {alerts - fired}"
    assert alerts - {"Watchdog"} <= quiet, f"alerts never tested quiet: {alerts - quiet}"


def alert_rules() -> list[dict]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"] if "alert" in r]


def github_anchors(markdown: str) -> set[str]:
    """Anchors GitHub (and most renderers) give the headings of a markdown file."""
    anchors = set()
    for m in re.finditer(r"^#{1,6}\s+(.+?)\s*$", markdown, re.M):
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        anchors.add(slug)
    return anchors


def test_every_alert_says_who_is_told_and_where_its_runbook_is():
    """severity routes it (critical only for the fleet's capacity), scope drives inhibition,
    and runbook_url points at an existing section of docs/fleet.md."""
    anchors = github_anchors((REPO / "docs/fleet.md").read_text(encoding="utf-8"))
    for rule in alert_rules():
        name, labels = rule["alert"], rule.get("labels", {})
        assert labels.get("severity") in {"critical", "warning", "info", "none"}, name
        assert labels.get("scope") in {"board", "host", "fleet"}, name
        if labels["severity"] == "critical":
            assert labels["scope"] == "fleet", f"{name}: only fleet-level alerts page"
        url = rule.get("annotations", {}).get("runbook_url", "")
        assert url == f"docs/fleet.md#{name.lower()}", f"{name}: runbook_url {url!r}"
        assert name.lower() in anchors, f"{name}: no section '### {name}' in docs/fleet.md"
    names = {r["alert"] for r in alert_rules()}
    assert {"Watchdog", "FleetBoardsReadyLow", "FleetDecodeSlow", "FleetReleaseSkew", "BoardDrainedTooLong",
            "NodeFilesystemSpaceFillingUp", "NodeFilesystemAlmostOutOfSpace", "NodeClockNotSynchronising",
            "NodeMemoryHighUtilization", "NodeOOMKillDetected", "NodeSystemdServiceFailed"} <= names


def test_the_dashboard_json_is_generated_from_its_script():
    run([sys.executable, MONITORING / "grafana" / "build_dashboard.py", "--check"])


def test_dashboard_structure():
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert board["uid"] and board["title"] and board["schemaVersion"] >= 30
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for needed in ("decode ms/token", "attention", "tokens/s", "temperature", "frequency", "throttl", "queue"):
        assert needed in titles, needed
    for p in board["panels"]:
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "fleet-prometheus"
        assert p["targets"] and p.get("description")
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
    provisioned = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/fleet.yml").read_text())
    assert provisioned["datasources"][0]["uid"] == "fleet-prometheus"


def test_every_dashboard_query_parses(tmp_path):
    """promtool parses each query (as a recording rule of a throwaway rule file)."""
    promtool = tool("promtool")
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": concrete(expr)} for i, (_, expr) in enumerate(dashboard_queries())]}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules), encoding="utf-8")
    run([promtool, "check", "rules", path])


def referenced_series() -> set[str]:
    exprs = [e for _, e in dashboard_queries()]
    for f in RULE_FILES:
        for g in yaml.safe_load(f.read_text())["groups"]:
            exprs += [r["expr"] for r in g["rules"]]
    return {m for e in exprs for m in re.findall(r"(?<![:\w])(appliance_[a-z0-9_]+)", e)}


def test_every_appliance_series_exists_in_the_exporter():
    """Names drift between teams: every appliance_* series the rules and dashboard read is
    declared in the server's package (base name; _bucket/_sum/_count/_total are derived)."""
    source = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "appliance").rglob("*.py"))
    declared = set(re.findall(r'"(appliance_[a-z0-9_]+)"', source))
    missing = set()
    for name in referenced_series():
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        if name not in declared and base not in declared:
            missing.add(name)
    assert not missing, f"series not exported by the appliance package: {sorted(missing)}"


def test_alertmanager_inhibits_a_down_boards_other_alerts(tmp_path):
    """The role's configuration in the real Alertmanager: with BoardDown firing for board3,
    board3's throttling alert is suppressed and never notified, board1's is notified once,
    and the Watchdog reaches the dead man's switch."""
    import http.server
    import socket
    import threading
    import time
    import urllib.request
    from conftest import render_role_template

    binary = tool("prometheus-alertmanager")
    received = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            received.append((self.path, json.loads(self.rfile.read(int(self.headers["Content-Length"])))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    hook = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{hook.server_address[1]}"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    config = tmp_path / "alertmanager.yml"
    config.write_text(render_role_template(
        "alertmanager", "alertmanager.yml.j2", alertmanager_group_wait="1s", alertmanager_group_interval="2s",
        alertmanager_watchdog_repeat_interval="2s",
        alertmanager_receivers=[{"name": n, "webhook_urls": [f"{base}/{n}"]} for n in ("oncall", "team", "deadmansswitch")]))
    proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.path={tmp_path}/data",
                             f"--web.listen-address=127.0.0.1:{port}", "--cluster.listen-address="],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    api = f"http://127.0.0.1:{port}/api/v2"

    def alert(name, board=None, **labels):
        labels = {"alertname": name, "fleet": "lab", **labels, **({"board": board} if board else {})}
        return {"labels": labels, "annotations": {"summary": name}}

    try:
        for _ in range(100):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        alerts = [alert("BoardDown", "board3", severity="warning", scope="board"),
                  alert("BoardThermalThrottling", "board3", severity="warning", scope="board"),
                  alert("BoardThermalThrottling", "board1", severity="warning", scope="board"),
                  alert("Watchdog", severity="none", scope="fleet")]
        request = urllib.request.Request(f"{api}/alerts", data=json.dumps(alerts).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        urllib.request.urlopen(request, timeout=5)
        deadline = time.time() + 20
        while time.time() < deadline and not ({"/team", "/deadmansswitch"} <= {p for p, _ in received}
                                              and len([1 for p, _ in received if p == "/team"]) >= 2):
            time.sleep(0.2)
        time.sleep(3)                                   # one more group interval: nothing new may come
        state = {(a["labels"]["alertname"], a["labels"].get("board")): a["status"]
                 for a in json.loads(urllib.request.urlopen(f"{api}/alerts", timeout=5).read())}
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        hook.shutdown()
    assert state[("BoardThermalThrottling", "board3")]["state"] == "suppressed"
    assert state[("BoardThermalThrottling", "board3")]["inhibitedBy"]
    assert state[("BoardThermalThrottling", "board1")]["state"] == "active"
    assert state[("BoardDown", "board3")]["state"] == "active", "an alert must not inhibit itself"
    notified = [(p, a["labels"]["alertname"], a["labels"].get("board")) for p, body in received for a in body["alerts"]]
    assert ("/team", "BoardDown", "board3") in notified
    assert notified.count(("/team", "BoardThermalThrottling", "board1")) == 1, notified
    assert ("/team", "BoardThermalThrottling", "board3") not in notified, notified
    assert ("/deadmansswitch", "Watchdog", None) in notified
    assert not [n for n in notified if n[0] == "/oncall"], "nothing critical fired, nobody may be paged"
