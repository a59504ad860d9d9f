"""The fleet on simulated boards that boot real systemd (tests/fleet/fleetlab.py): site.yml
converges, a second run changes nothing, the appliance runs hardened under systemd with its
logs in journald, and every restart is a rollout - an upgrade, a group-variable change, a
broken release that is rolled back - while a client streams 200-token answers through the
load balancer without one failed or cut request."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from conftest import ANSIBLE_DIR
from fleetlab import (BOARDS, BROKEN_SUFFIX, HOSTS, LAB_DIR, LB, STEPS, UPGRADE_SUFFIX, API_KEY, board_file, need,
                      recap)

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
SERVICE_PROPS = ("ActiveEnterTimestamp", "ActiveState", "MainPID")


def current_release(lab, board: str) -> str:
    return lab.on(board, "readlink", "/opt/appliance/current").strip()


def test_site_converges_on_systemd_boards(lab):
    rc, out = lab.playbook("site.yml", "-e", f"appliance_source_dir={LAB_DIR / 'src-v1'}")
    assert rc == 0, out[-8000:]
    hosts = recap(out)
    assert set(hosts) == set(HOSTS)
    assert all(h["failed"] == 0 and h["unreachable"] == 0 for h in hosts.values()), hosts
    for host in HOSTS:
        assert lab.on(host, "systemctl", "is-system-running", check=False).strip() == "running", \
            f"{host}: " + lab.on(host, "systemctl", "--failed", "--no-legend", check=False)
    for board in BOARDS:
        built = list(board_file(board, "/opt/appliance/releases").glob(
            "*/venv/lib/python3*/site-packages/appliance/**/_kernels*.so"))
        assert len(built) == 1, f"{board}: kernels not built in its own /opt: {built}"
        assert lab.unit(board, "appliance.service", "UnitFileState")["UnitFileState"] == "enabled"
        governor = LAB_DIR / "hosts" / board / "srv/fake-sysfs/class/devfreq/dmc/governor"
        assert governor.read_text().strip() == "performance", f"{board}: DDR governor not pinned"
    for host, unit in [("lb", "nginx.service"), ("mon", "prometheus.service"),
                       ("mon", "prometheus-alertmanager.service"), ("board1", "prometheus-node-exporter.service")]:
        assert lab.unit(host, unit, "ActiveState")["ActiveState"] == "active", f"{host}: {unit}"
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
    changed = {h: v["changed"] for h, v in recap(out).items() if v["changed"]}
    assert not changed, f"not idempotent: {changed}\n" + "\n".join(
        l for l in out.splitlines() if l.startswith("changed:") or l.startswith("TASK"))[-6000:]
    assert out.count("msg: nothing to restart") == len(BOARDS)
    STEPS["idempotent"] = True


def test_the_appliance_runs_hardened_under_systemd_with_its_logs_in_journald(lab):
    """What systemd enforces, read live on every board: the exposure score, the user, the
    kernel's memory limit and CPU weight on the service's cgroup, no privileges, the release
    build's own scope, and the server's own lines in the journal."""
    need("site")
    defaults = yaml.safe_load((ANSIBLE_DIR / "roles/appliance/defaults/main.yml").read_text())
    exposure_max, cpu_weight = defaults["appliance_security_exposure_max"], defaults["appliance_cpu_weight"]
    memory_max = yaml.safe_load((ANSIBLE_DIR / "inventories/lab/group_vars/boards.yml").read_text())[
        "appliance_memory_max"]
    assert memory_max.endswith("M")
    for board in BOARDS:
        security = lab.on(board, "systemd-analyze", "security", "--no-pager", "appliance.service")
        exposure = float(re.search(r"Overall exposure level for appliance\.service: ([0-9.]+)", security).group(1))
        print(f"{board}: systemd-analyze security exposure {exposure}")
        assert exposure <= exposure_max, security[-3000:]
        unit = lab.unit(board, "appliance.service", "User", "MemoryMax", "MainPID", "NoNewPrivileges",
                        "ProtectSystem", "OOMPolicy", "Slice")
        assert unit["User"] == "appliance" and unit["NoNewPrivileges"] == "yes" and unit["ProtectSystem"] == "strict"
        assert unit["OOMPolicy"] == "stop"
        assert int(unit["MemoryMax"]) == int(memory_max[:-1]) * 1024 * 1024
        pid = unit["MainPID"]
        status = lab.on(board, "cat", f"/proc/{pid}/status")
        uid = lab.on(board, "id", "-u", "appliance").strip()
        assert re.search(rf"^Uid:\s+{uid}\s", status, re.M), status
        assert re.search(r"^NoNewPrivs:\s+1$", status, re.M) and re.search(r"^CapEff:\s+0+$", status, re.M)
        cgroup = lab.on(board, "cat", f"/proc/{pid}/cgroup")
        assert re.search(r"^\d+:memory:/appliance\.slice/appliance\.service$", cgroup, re.M), cgroup
        kernel_limit = lab.on(board, "cat", "/sys/fs/cgroup/memory/appliance.slice/appliance.service/memory.limit_in_bytes")
        assert int(kernel_limit) == int(unit["MemoryMax"]), "the kernel does not enforce MemoryMax"
        # A contended core goes to decode first: the service runs in its own top-level slice, whose
        # weight the kernel holds against system.slice's (v1: shares = weight * 1024 / 100).
        assert unit["Slice"] == "appliance.slice"
        # (systemd makes the service a cpu group of its own only when the unit sets a weight itself)
        assert re.search(r"^\d+:cpu(,cpuacct)?:/appliance\.slice(/appliance\.service)?$", cgroup, re.M), cgroup
        shares = {group: int(lab.on(board, "cat", f"/sys/fs/cgroup/cpu/{group}/cpu.shares"))
                  for group in ("appliance.slice", "system.slice")}
        assert shares == {"appliance.slice": cpu_weight * 1024 // 100, "system.slice": 1024}, \
            "the kernel does not weigh the service's CPU time"
        # The release was built in a low-weight scope of its own in system.slice.
        systemd_lines = lab.on(board, "journalctl", "--no-pager", "-o", "cat", "_PID=1")
        assert re.search(r"Started .*Build of appliance release", systemd_lines), systemd_lines[-2000:]
        journal = [json.loads(l) for l in lab.on(board, "journalctl", "-u", "appliance.service", "-o", "json",
                                                 "--no-pager").splitlines()]
        own = [e for e in journal if e.get("_UID") == uid]
        assert own, f"{board}: no line of the appliance itself in the journal"
        assert any(re.search(r"selftest|Listening", str(e.get("MESSAGE", ""))) for e in own), \
            [e.get("MESSAGE") for e in own][-10:]


def assert_no_request_failed(stats: dict, minimum: int) -> None:
    assert stats["failed"] == 0 and stats["cut"] == 0, stats["errors"][:20]
    assert stats["ok"] >= minimum and stats["streams"] >= minimum // 2, stats
    assert stats["max_tokens"] >= 200


def test_rollout_drains_each_board_in_turn_without_a_failed_or_cut_request(lab):
    """The upgrade: batches of [1, 10%, 50%] of three boards are three batches of one; each
    board leaves the load balancer before its restart and comes back after its gate."""
    need("site")
    before = {b: current_release(lab, b) for b in BOARDS}
    rc, out, stats = lab.playbook_under_load("rollout-client", "rollout.yml", "-e",
                                             f"appliance_source_dir={LAB_DIR / 'src-v2'}")
    assert rc == 0, out[-8000:]
    assert_no_request_failed(stats, 30)
    assert out.count("PLAY [Restart the boards that changed") == 3, "expected three batches of one board"
    assert out.count("(in service: drained first)") == len(BOARDS)
    for board in BOARDS:
        assert lab.board_version(board).endswith(UPGRADE_SUFFIX)
        assert current_release(lab, board) != before[board]
        releases = [p for p in board_file(board, "/opt/appliance/releases").iterdir() if p.is_dir()]
        assert len(releases) == 2, f"{board}: releases {releases}"
        drained = lab.query(f'max_over_time(fleet_loadbalancer_board_drained{{board="{board}"}}[15m])')
        assert drained and float(drained[0]["value"][1]) == 1, f"{board} never left the load balancer"
    at_once = lab.query("max_over_time(sum(fleet_loadbalancer_board_drained)[15m:1s])")
    assert float(at_once[0]["value"][1]) == 1, "more than one board was out of rotation at once"
    assert json.loads(board_file("lb", "/var/lib/appliance-loadbalancer/drained.json").read_text()) == {}
    upstreams = board_file("lb", "/etc/nginx/conf.d/appliance-upstreams.conf").read_text()
    assert " down;" not in upstreams, "a board was left out of the load balancer"
    STEPS["rollout"] = True


def test_site_after_a_group_variable_change_restarts_in_batches_without_a_failed_or_cut_request(lab):
    """An operator edits group_vars/boards (a second inventory source here) and re-runs
    site.yml: the settings change restarts every board through the same drained batches."""
    need("rollout")
    override = LAB_DIR / "override"
    (override / "group_vars").mkdir(parents=True)
    (override / "hosts.yml").write_text("all:\n  children:\n    boards: {}\n")
    (override / "group_vars" / "boards.yml").write_text("appliance_max_batch: 3\n")
    started = {b: lab.unit(b, "appliance.service", *SERVICE_PROPS) for b in BOARDS}
    rc, out, stats = lab.playbook_under_load("site-change-client", "site.yml", "-e",
                                             f"appliance_source_dir={LAB_DIR / 'src-v2'}",
                                             inventories=[override / "hosts.yml"])
    assert rc == 0, out[-8000:]
    assert_no_request_failed(stats, 30)
    assert out.count("msg: 'restart: settings (in service: drained first)'") == len(BOARDS)
    assert out.count("PLAY [Restart the boards that changed") == 3
    for board in BOARDS:
        settings = yaml.safe_load(board_file(board, "/etc/appliance/appliance.yml").read_text())
        assert settings["max_batch"] == 3
        now = lab.unit(board, "appliance.service", *SERVICE_PROPS)
        assert now["ActiveState"] == "active" and now["ActiveEnterTimestamp"] != started[board]["ActiveEnterTimestamp"]
    STEPS["site-change"] = True


def test_a_broken_release_is_rolled_back_and_stops_the_rollout_and_an_unreachable_board_is_left_out(lab):
    """Its selftest passes, its server never becomes ready: the first board fails its gate,
    goes back to the release it ran, returns to rotation, and nothing else restarts. board3
    does not answer meanwhile (its network is down): one board of three is within the lab's
    bound (fleet_rollout_max_unreachable_percent: 34), so the rollout goes on without it."""
    need("rollout")
    before = {b: current_release(lab, b) for b in BOARDS}
    started = {b: lab.unit(b, "appliance.service", *SERVICE_PROPS)["ActiveEnterTimestamp"] for b in BOARDS}
    lab.cut_off("board3")
    try:
        rc, out, stats = lab.playbook_under_load("broken-client", "rollout.yml", "-e",
                                                 f"appliance_source_dir={LAB_DIR / 'src-v3'}",
                                                 "-e", "appliance_health_retries=15")
    finally:
        lab.cut_off("board3", up=True)
    assert rc != 0, "a failed gate must fail the run"
    assert_no_request_failed(stats, 10)
    flat = " ".join(out.split())
    assert recap(out)["board3"]["unreachable"] == 1
    assert "unreachable, left out of this rollout: board3 (at most 34% of the fleet may be)" in flat, out[-6000:]
    stop = re.search(r"rollout stopped: (board\d): (.*?) failed the health gate \((.*?)\); rolled back to release "
                     r"(\w+), healthy again; back in rotation", flat)
    assert stop, out[-6000:]
    failed_board, reasons, why, back_to = stop.groups()
    print(f"rollback: {failed_board}: {reasons} -> {why} -> back to {back_to}")
    assert failed_board == "board1" and "release" in reasons and "ready" in why.lower()
    assert current_release(lab, "board1") == before["board1"] and before["board1"].split("/")[-1].startswith(back_to)
    lab.wait_for("board3 answering again", lambda: lab.get(f"{LB}/boards/board3/ready")[0] == 200, timeout=60)
    for board in BOARDS:
        code, body = lab.get(f"{LB}/boards/{board}/health")
        assert code == 200 and json.loads(body)["status"] == "ready", f"{board}: {code} {body[:200]}"
        version = lab.board_version(board)
        assert version.endswith(UPGRADE_SUFFIX) and not version.endswith(BROKEN_SUFFIX), f"{board} runs {version}"
        assert current_release(lab, board) == before[board]
    for board in BOARDS[1:]:
        assert lab.unit(board, "appliance.service", "ActiveEnterTimestamp")["ActiveEnterTimestamp"] == started[board], \
            f"{board} restarted after the rollout stopped"
    assert len(list(board_file("board3", "/opt/appliance/releases").iterdir())) == 2, "board3 built the new release"
    assert out.count("PLAY [Restart the boards that changed") == 1
    assert json.loads(board_file("lb", "/var/lib/appliance-loadbalancer/drained.json").read_text()) == {}
    assert " down;" not in board_file("lb", "/etc/nginx/conf.d/appliance-upstreams.conf").read_text()
