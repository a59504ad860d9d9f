"""Static checks of monitoring/: promtool on config, rules and rule tests; the dashboard's
structure and every one of its queries; metric names against the server's exporter."""
from __future__ import annotations

import json
import re
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
    """Each alert is tested; in every test with a firing alert some input board stays quiet."""
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
    assert alerts <= quiet, f"alerts never tested quiet: {alerts - quiet}"


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
    declared in appliance/metrics.py (base name; _bucket/_sum/_count/_total are derived)."""
    source = (REPO / "appliance" / "metrics.py").read_text(encoding="utf-8")
    declared = set(re.findall(r'"(appliance_[a-z0-9_]+)"', source))
    missing = set()
    for name in referenced_series():
        base = re.sub(r"_(bucket|sum|count|total)$", "", name)
        if name not in declared and base not in declared:
            missing.add(name)
    assert not missing, f"series not exported by appliance/metrics.py: {sorted(missing)}"
