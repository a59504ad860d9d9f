"""Monitoring on the simulated fleet (tests/fleet/fleetlab.py, after test_lab.py): Prometheus
scrapes every target and hands alerts to Alertmanager; every dashboard query has data; a hot
sensor's throttling alert reaches a webhook receiver exactly once; a board whose appliance is
stopped notifies for being down, not also for its temperature; bench.yml gathers a table."""
from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, concrete, dashboard_queries, tool
from fleetlab import BOARDS, HOSTS, LAB_DIR, LB, STEPS, need

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
FAKE_SYSFS = REPO / "scripts/lab/fake_sysfs.py"
RUNBOOKS = "https://runbooks.fleet-lab.invalid/appliance/docs/fleet.md#"


def sensor(board: str, action: str) -> None:
    subprocess.run([sys.executable, FAKE_SYSFS, action, LAB_DIR / "hosts" / board / "srv/fake-sysfs"], check=True)


def firing(lab, alertname: str) -> set[str]:
    return {a["metric"].get("board", a["metric"].get("instance"))
            for a in lab.query(f'ALERTS{{alertname="{alertname}",alertstate="firing"}}')}


def delivered(lab, receiver: str, alertname: str, board: str | None = None, status: str = "firing") -> list[dict]:
    """Notifications to `receiver` that carried `alertname` (for `board`) in `status`."""
    return [n for n in lab.notifications(receiver)
            if any(a["labels"]["alertname"] == alertname and a["status"] == status
                   and (board is None or a["labels"].get("board") == board) for a in n["alerts"])]


def test_prometheus_scrapes_every_target_and_alerts_through_alertmanager(lab):
    need("site")
    expected = {("appliance", b) for b in BOARDS} | {("node", h) for h in HOSTS}

    def up():
        got = {(r["metric"]["job"], r["metric"]["instance"]) for r in lab.query("up == 1")}
        return expected <= got and lab.query('up{job="alertmanager"} == 1')

    lab.wait_for("every target up", up, timeout=60)
    code, body = lab.get("http://10.78.0.2:9090/api/v1/alertmanagers")
    assert code == 200 and '"activeAlertmanagers":[{' in body.replace(" ", ""), body[:300]
    assert len(lab.query('node_thermal_zone_temp{board="board1"}')) == 7, "board1's fake RK3588 sysfs is not read"

    def drained():
        return {r["metric"]["board"]: r["value"][1] for r in lab.query("fleet_loadbalancer_board_drained")}

    # The rollback test before this one returned board1 to rotation moments ago; node_exporter's
    # textfile is scraped every 5 s, so the last sample may still say drained for one interval.
    lab.wait_for("every board in rotation", lambda: drained() == {b: "0" for b in BOARDS}, timeout=30)

    def active():
        return {r["metric"]["board"] for r in
                lab.query('node_systemd_unit_state{name="appliance.service",state="active"} == 1')}

    # board1's unit restarted in the rollback moments ago: one scrape may still say otherwise
    lab.wait_for("node_exporter's systemd collector: every board's appliance active",
                 lambda: active() == set(BOARDS), timeout=30)
    thresholds = lab.query("fleet:appliance_boards_ready:min_threshold")
    assert thresholds and thresholds[0]["value"][1] == "2"
    code, metrics = lab.get(f"{LB}/boards/board1/metrics")
    assert code == 200
    check = subprocess.run([tool("promtool"), "check", "metrics"], input=metrics, capture_output=True, text=True)
    assert "error" not in (check.stdout + check.stderr).lower(), check.stdout + check.stderr
    STEPS["prometheus"] = True


def test_every_dashboard_query_returns_data(lab):
    need("prometheus")
    loop = lab.client_loop("dashboard-client", max_seconds=120, pause=0.2, max_tokens=32)
    try:
        empty = {}
        deadline = time.monotonic() + 60
        for title, expr in dashboard_queries(annotations=False):  # panels; the alert annotation may be empty
            while True:
                values = [float(r["value"][1]) for r in lab.query(concrete(expr))]
                if any(math.isfinite(v) for v in values):
                    break
                if time.monotonic() > deadline:
                    empty[title] = (concrete(expr), values)
                    break
                time.sleep(2)
    finally:
        lab.finish(loop)
    assert not empty, f"queries without data: {empty}"


def test_a_hot_sensor_fires_the_throttling_alert_and_alertmanager_delivers_it_once(lab):
    need("prometheus")
    sensor("board2", "heat")
    try:
        lab.wait_for("BoardThermalThrottling firing for board2", lambda: "board2" in firing(lab, "BoardThermalThrottling"),
                     timeout=90)
        assert firing(lab, "BoardThermalThrottling") == {"board2"}, "other boards alerted too"
        notes = lab.wait_for("the team's webhook receiving it",
                             lambda: delivered(lab, "team", "BoardThermalThrottling", "board2"), timeout=60, every=1)
        first = time.time()
        time.sleep(25)                      # more than two group intervals (10 s): nothing again
        notes = delivered(lab, "team", "BoardThermalThrottling", "board2")
        assert len(notes) == 1, f"delivered {len(notes)} times in {time.time() - first:.0f} s"
        note = notes[0]
        assert note["receiver"] == "team" and note["groupLabels"] == {"alertname": "BoardThermalThrottling",
                                                                        "fleet": "lab"}
        alert = next(a for a in note["alerts"] if a["labels"].get("board") == "board2")
        assert alert["labels"]["severity"] == "warning" and alert["labels"]["scope"] == "board"
        assert alert["annotations"]["runbook_url"] == RUNBOOKS + "boardthermalthrottling"
        assert not delivered(lab, "oncall", "BoardThermalThrottling"), "a warning must not page"
        watchdog = [n for n in lab.notifications("deadmansswitch") if n["commonLabels"].get("alertname") == "Watchdog"]
        assert len(watchdog) >= 2, "the dead man's switch hears the Watchdog again and again"
    finally:
        sensor("board2", "cool")
    lab.wait_for("the throttling alert resolved", lambda: delivered(lab, "team", "BoardThermalThrottling", "board2",
                                                                    status="resolved"), timeout=90)
    STEPS["alerting"] = True


def test_a_board_whose_appliance_is_stopped_does_not_also_notify_for_its_temperature(lab):
    need("alerting")
    lab.on("board3", "systemctl", "stop", "appliance.service")
    try:
        # Down first, hot after: what starts while BoardDown fires is held back. (Heated at
        # once, the throttling alert may reach Alertmanager a rule evaluation before
        # BoardDown does, and be notified before anything inhibits it.)
        lab.wait_for("Alertmanager knowing board3 is down", lambda: [
            a for a in lab.alertmanager_alerts() if a["labels"]["alertname"] == "BoardDown"
            and a["labels"].get("board") == "board3" and a["status"]["state"] == "active"], timeout=120, every=1)
        sensor("board3", "heat")
        lab.wait_for("BoardDown and BoardThermalThrottling firing for board3",
                     lambda: "board3" in firing(lab, "BoardDown") and "board3" in firing(lab, "BoardThermalThrottling"),
                     timeout=120)

        def suppressed():
            return [a for a in lab.alertmanager_alerts() if a["labels"]["alertname"] == "BoardThermalThrottling"
                    and a["labels"].get("board") == "board3" and a["status"]["state"] == "suppressed"]

        held = lab.wait_for("Alertmanager holding board3's throttling back", suppressed, timeout=60, every=1)
        assert held[0]["status"]["inhibitedBy"], held
        lab.wait_for("BoardDown delivered for board3", lambda: delivered(lab, "team", "BoardDown", "board3"),
                     timeout=60, every=1)
        time.sleep(12)                      # past the group interval
        for receiver in ("team", "oncall"):
            assert not delivered(lab, receiver, "BoardThermalThrottling", "board3"), receiver
    finally:
        sensor("board3", "cool")
        lab.on("board3", "systemctl", "start", "appliance.service")
    lab.wait_for("board3 serving again", lambda: lab.get(f"{LB}/boards/board3/ready")[0] == 200, timeout=120)


def test_bench_gathers_one_fleet_table(lab):
    need("site")
    out_dir = LAB_DIR / "bench"
    rc, out = lab.playbook("bench.yml", "-e", "fleet_bench_context=32", "-e", "fleet_bench_gen=4",
                           "-e", f"fleet_bench_output_dir={out_dir}")
    assert rc == 0, out[-6000:]
    table = (out_dir / "fleet-bench.md").read_text()
    for board in BOARDS:
        assert re.search(rf"^\| 32 \| {board} \| exact \| [0-9.]+ \|", table, re.M), table
