"""A thousand boards without a lab: Prometheus's targets from files (the boards scraped
through the load balancer over TLS), the dashboard leading with fleet aggregates."""
from __future__ import annotations

import json

from conftest import DASHBOARD, render_role_template

INVENTORY = {"board1": {"ansible_host": "10.0.0.11"}, "board2": {"ansible_host": "10.0.0.12"},
             "lb": {"ansible_host": "10.0.0.3"}, "mon": {"ansible_host": "10.0.0.2", "fleet_address": "fd00::2"}}
GROUPS = {"boards": ["board1", "board2"], "loadbalancer": ["lb"], "monitoring": ["mon"]}


def file_sd(hosts, via=""):
    return json.loads(render_role_template("prometheus", "file_sd.json.j2", groups=GROUPS, hostvars=INVENTORY,
                                           prometheus_file_sd_hosts=hosts, prometheus_file_sd_port=9100,
                                           prometheus_file_sd_via=via))


def test_prometheus_discovers_the_inventory_from_files():
    assert file_sd(["board2", "board1", "mon"]) == [
        {"targets": ["10.0.0.11:9100"], "labels": {"instance": "board1", "board": "board1"}},
        {"targets": ["10.0.0.12:9100"], "labels": {"instance": "board2", "board": "board2"}},
        {"targets": ["[fd00::2]:9100"], "labels": {"instance": "mon"}}]
    assert file_sd(["board1"], via="10.0.0.3:443") == [
        {"targets": ["10.0.0.3:443"], "labels": {"instance": "board1", "board": "board1",
                                                 "__metrics_path__": "/boards/board1/metrics"}}]


def test_a_board_with_several_instances_is_one_target_per_instance():
    """Each instance's own /metrics (its model, its queue), told apart by instance_name;
    the node job still sees the board once."""
    hostvars = dict(INVENTORY, board1={"ansible_host": "10.0.0.11", "appliance_instances": [
        {"name": "embed", "port": 8081, "task": "embed"}, {"name": "chat", "port": 8080}]})

    def targets(via="", instances=True):
        return json.loads(render_role_template(
            "prometheus", "file_sd.json.j2", groups=GROUPS, hostvars=hostvars, prometheus_file_sd_hosts=["board1"],
            prometheus_file_sd_port=8080, prometheus_file_sd_via=via, prometheus_file_sd_instances=instances))

    assert targets() == [
        {"targets": ["10.0.0.11:8080"], "labels": {"instance": "board1/chat", "board": "board1",
                                                   "instance_name": "chat"}},
        {"targets": ["10.0.0.11:8081"], "labels": {"instance": "board1/embed", "board": "board1",
                                                   "instance_name": "embed"}}]
    assert [t["labels"]["__metrics_path__"] for t in targets(via="10.0.0.3:443")] == [
        "/boards/board1/chat/metrics", "/boards/board1/embed/metrics"]
    assert targets(instances=False) == [
        {"targets": ["10.0.0.11:8080"], "labels": {"instance": "board1", "board": "board1"}}]


def test_the_scrape_configuration_has_no_targets_and_scrapes_over_tls_with_a_password_file():
    config = render_role_template("prometheus", "prometheus.yml.j2", groups=GROUPS, hostvars=INVENTORY,
                                  inventory_hostname="mon", prometheus_appliance_via="10.0.0.3:443")
    assert config.count("file_sd_configs:") == 2 and "10.0.0.11" not in config
    assert config.count("scheme: https") == 2 and config.count("password_file: /etc/prometheus/scrape-password") == 2
    plain = render_role_template("prometheus", "prometheus.yml.j2", groups=GROUPS, hostvars=INVENTORY,
                                 inventory_hostname="mon", prometheus_scrape_tls=False, prometheus_appliance_via="")
    assert "scheme: https" not in plain and "basic_auth" not in plain


def test_the_dashboard_leads_with_fleet_aggregates_and_drills_down_by_board():
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    first_row = board["panels"][0]
    assert first_row["type"] == "row" and first_row["title"] == "Fleet at a glance"
    glance = []
    for p in board["panels"][1:]:
        if p["type"] == "row":
            break
        glance.append(p)
    exprs = {p["title"]: [t["expr"] for t in p["targets"]] for p in glance}
    decode = next(e for t, e in exprs.items() if t.startswith("Fleet decode"))
    assert [e.split(",")[0] for e in decode] == ["1000 * histogram_quantile(0.5", "1000 * histogram_quantile(0.95",
                                                 "1000 * histogram_quantile(0.99"]
    assert all("sum by (le)" in e for e in decode), "the quantiles must be of the fleet, not of each board"
    assert any(e.startswith("topk(5, ") for e in exprs["Hottest boards (top 5)"])
    assert {t["legendFormat"] for p in glance if p["title"] == "Boards by state" for t in p["targets"]} == {
        "serving", "drained", "loading", "down"}
    heatmap = next(p for p in glance if p["type"] == "heatmap")
    assert heatmap["options"]["calculate"] is True
    variable = board["templating"]["list"][0]
    assert variable["name"] == "board" and variable["includeAll"] and variable["multi"]
    assert all('board=~"$board"' in t["expr"] for p in glance for t in p["targets"])
