#!/usr/bin/env python3
"""Writes dashboards/fleet.json, the Grafana dashboard of the appliance fleet.

    python3 monitoring/grafana/build_dashboard.py [--check]

The panels are data (PANELS below): one place to read what each shows and why.
--check exits 1 when the committed JSON differs from what this script generates.
Every query is run through promtool and against a live Prometheus by tests/fleet.
"""
from __future__ import annotations

import json
import os
import sys

DATASOURCE = {"type": "prometheus", "uid": "fleet-prometheus"}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dashboards", "fleet.json")
B = 'board=~"$board"'

# (row title, [(panel type, title, unit, description, [(expr, legend)], width)])
# Grafana's rate window, and what the fleet-wide decode quantiles are computed from.
DECODE = f"sum by (le) (rate(appliance_decode_token_seconds_bucket{{{B}}}[$__rate_interval]))"

# A board counts once in the board counts, however many appliance instances it runs: up
# (loaded) only when every instance is.
UP = f'min by (board) (up{{job="appliance", {B}}})'
LOADED = f"min by (board) (appliance_model_loaded{{{B}}})"

PANELS = [
    ("Fleet at a glance", [
        ("timeseries", "Fleet decode ms/token (p50, p95, p99)", "ms",
         "Time per output token over every selected board's decode steps together: what a client of "
         "the fleet feels. Pick boards with the Board variable to see one of them alone.",
         [(f"1000 * histogram_quantile({q}, {DECODE})", f"p{round(q * 100)}") for q in (0.5, 0.95, 0.99)], 8),
        ("timeseries", "Hottest boards (top 5)", "celsius",
         "The five selected boards whose hottest thermal zone is the hottest now; RK3588 throttles at "
         "85 C. Drill down with the Board variable.",
         [(f"topk(5, board:node_thermal_zone_temp_celsius:max{{{B}}})", "{{board}}")], 8),
        ("timeseries", "Boards by state", "none",
         "Serving: up, model loaded, in the load balancer's rotation. Drained: out of rotation (a "
         "rollout, the operator). Loading: up without a model yet. Down: Prometheus cannot scrape it.",
         [(f"count({UP} == 1 and on (board) {LOADED} == 1 "
           f"unless on (board) max by (board) (fleet_loadbalancer_board_drained{{{B}}}) == 1) or vector(0)",
           "serving"),
          (f"count(max by (board) (fleet_loadbalancer_board_drained{{{B}}}) == 1) or vector(0)", "drained"),
          (f"count({UP} == 1 unless on (board) {LOADED} == 1) or vector(0)", "loading"),
          (f"count({UP} == 0) or vector(0)", "down")], 8),
        ("heatmap", "Temperature across the fleet", "celsius",
         "How many boards sit at each temperature (each board's hottest zone), over time: a fleet "
         "drifting up is the room; a few boards apart from the rest are their heatsinks or fans.",
         [(f"board:node_thermal_zone_temp_celsius:max{{{B}}}", "{{board}}")], 24),
    ]),
    ("Fleet", [
        ("stat", "Boards serving", "none",
         "Boards whose appliance (every instance of it) answers Prometheus (of those selected).",
         [(f"count({UP} == 1) or vector(0)", "serving")], 6),
        ("stat", "Fleet tokens/s", "none",
         "Generated tokens per second, all selected boards together.",
         [(f"sum(board:appliance_generation_tokens:rate1m{{{B}}})", "tokens/s")], 6),
        ("stat", "Requests waiting", "none",
         "Requests queued for a decode slot across the fleet. Sustained > 0: add boards or raise max_batch.",
         [(f"sum(appliance_requests_waiting{{{B}}})", "waiting")], 6),
        ("stat", "Boards throttled", "none",
         "Boards with at least one CPU cluster held below its maximum frequency.",
         [(f"count(board:cpu_throttled:max{{{B}}} > 0) or vector(0)", "throttled")], 6),
    ]),
    ("Instances", [
        ("table", "Appliance instances", "none",
         "Every appliance instance of the selected boards and what it serves: a board with several "
         "models (appliance_instances) runs one instance per model, each its own unit, port and "
         "cores; the load balancer routes to them by `model` and path. An instance missing here is "
         "down (BoardDown names it).",
         [(f"max by (board, instance_name, served_name, task) (appliance_served_model_info{{{B}}})",
           "")], 24),
    ]),
    ("Rollouts", [
        ("timeseries", "Out of the load balancer", "none",
         "1 while the load balancer keeps a board out of rotation: a rollout draining and "
         "restarting it, or the operator (loadbalancer_drained). A board left out for long "
         "is a rollout that stopped (BoardDrainedTooLong).",
         [(f"max by (board) (fleet_loadbalancer_board_drained{{{B}}})", "{{board}}")], 12),
        ("timeseries", "Boards per release", "none",
         "How many boards serve each appliance version: two lines while a rollout runs, one "
         "after it; two for an hour is FleetReleaseSkew.",
         [(f"count by (version) (appliance_build_info{{{B}}})", "{{version}}")], 12),
    ]),
    ("Decode", [
        ("timeseries", "Decode ms/token (p50)", "ms",
         "Median time to produce one output token, per board (5-minute window). Boards of one "
         "model should sit together; one above the rest is throttling or misconfigured.",
         [(f"board:appliance_decode_ms_per_token:p50_5m{{{B}}}", "{{board}}")], 12),
        ("timeseries", "Decode ms/token (p95)", "ms",
         "95th percentile: spikes here with a flat p50 are long contexts or batches.",
         [(f"board:appliance_decode_ms_per_token:p95_5m{{{B}}}", "{{board}}")], 12),
        ("timeseries", "Tokens/s per board", "none",
         "Generated tokens per second on each board (all its streams together).",
         [(f"board:appliance_generation_tokens:rate1m{{{B}}}", "{{board}}")], 8),
        ("timeseries", "Attention share of decode", "percentunit",
         "Share of each decode step spent in attention (p50, and the latest step). It grows with "
         "context; above 50% at long context, sparse attention pays off.",
         [(f"board:appliance_decode_attention_ratio:p50_5m{{{B}}}", "{{board}} p50"),
          (f"appliance_decode_attention_last_ratio{{{B}}}", "{{board}} last")], 8),
        ("timeseries", "Decode context (p95)", "none",
         "Context length of the sequences being decoded, in tokens.",
         [(f"board:appliance_decode_context_tokens:p95_5m{{{B}}}", "{{board}}")], 8),
        ("timeseries", "CPU wait", "percentunit",
         "How long the appliance's threads waited for a CPU per second they ran (the kernel's "
         "run-queue wait): near 0 on a board to itself, about a third beside a busy process that "
         "the appliance's slice outweighs, near 100% when that process takes a core's share and "
         "decode slows down (BoardCpuContended above 50%).",
         [(f"sum by (board) (rate(appliance_cpu_wait_seconds_total{{{B}}}[5m])) / "
           f"sum by (board) (rate(appliance_cpu_run_seconds_total{{{B}}}[5m]))", "{{board}}")], 24),
    ]),
    ("Thermals and frequency", [
        ("timeseries", "Temperatures", "celsius",
         "Every thermal zone of every board. RK3588 starts throttling at its passive trip point "
         "(85 C on most boards): a zone near it needs a better heatsink or a fan.",
         [(f"appliance_thermal_zone_temperature_celsius{{{B}}}", "{{board}} {{zone}}"),
          (f"board:node_thermal_zone_temp_celsius:max{{{B}}}", "{{board}} hottest (node_exporter)")], 12),
        ("timeseries", "CPU frequency", "hertz",
         "Current frequency per cpufreq policy (policy0: A55, policy4/6: A76) and the limit in "
         "force. With the performance governor the current line sits on the limit; a limit below "
         "the hardware maximum is thermal throttling.",
         [(f"appliance_cpu_frequency_hertz{{{B}}}", "{{board}} {{policy}}"),
          (f"appliance_cpu_frequency_max_hertz{{{B}}}", "{{board}} {{policy}} limit")], 12),
        ("timeseries", "Throttling", "none",
         "1 while a CPU cluster is throttled (per policy), and the share of time spent throttled.",
         [(f"appliance_cpu_throttled{{{B}}}", "{{board}} {{policy}}"),
          (f"rate(appliance_cpu_throttled_seconds_total{{{B}}}[$__rate_interval])",
           "{{board}} {{policy}} share of time")], 24),
    ]),
    ("Queue and requests", [
        ("timeseries", "Queue", "none",
         "Requests decoding now and requests waiting for a slot, per board.",
         [(f"appliance_requests_running{{{B}}}", "{{board}} running"),
          (f"appliance_requests_waiting{{{B}}}", "{{board}} waiting")], 8),
        ("timeseries", "Requests by outcome", "reqps",
         "Finished requests per second by outcome: stop/length are normal; rejected means a full "
         "queue (503), error/timeout need a look at the board's log.",
         [(f"sum by (board, outcome) (rate(appliance_requests_total{{{B}}}[$__rate_interval]))",
           "{{board}} {{outcome}}")], 8),
        ("timeseries", "Time to first token (p95)", "s",
         "Arrival to first token: queueing plus prefill.",
         [(f"histogram_quantile(0.95, sum by (board, le) "
           f"(rate(appliance_time_to_first_token_seconds_bucket{{{B}}}[$__rate_interval])))", "{{board}}")], 8),
    ]),
    ("Sessions and prefix cache", [
        ("timeseries", "Prefix cache hit rate", "percentunit",
         "Share of prompt tokens each board took from its prefix cache instead of computing them "
         "(5-minute window). The load balancer sends a session (X-Session-Id, else the API key, "
         "else the client address) back to the same board, so multi-turn chats and shared system "
         "prompts hit here; a board far below the others after a rollout or a drain is rebuilding "
         "its cache (the sessions it got from the others).",
         [(f"sum by (instance) (rate(appliance_prefix_cache_hits_total{{{B}}}[5m])) / "
           f"sum by (instance) (rate(appliance_prefix_cache_queries_total{{{B}}}[5m]))", "{{instance}}")], 24),
    ]),
]


def panel(pid: int, kind: str, title: str, unit: str, description: str, targets, x: int, y: int, w: int) -> dict:
    p = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DATASOURCE,
        "gridPos": {"x": x, "y": y, "w": w, "h": {"stat": 4, "table": 6}.get(kind, 8)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr,
                     "legendFormat": legend, "range": True}
                    for i, (expr, legend) in enumerate(targets)],
    }
    if kind == "stat":
        p["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                        "colorMode": "value", "graphMode": "area", "textMode": "auto"}
    elif kind == "table":
        # one row per series of an instant query, its labels the columns
        for t in p["targets"]:
            t.update(range=False, instant=True, format="table")
        p["transformations"] = [{"id": "organize", "options": {
            "excludeByName": {"Time": True, "Value": True},
            "renameByName": {"board": "Board", "instance_name": "Instance", "served_name": "Model",
                             "task": "Task"}}}]
        p["options"] = {"showHeader": True, "sortBy": [{"displayName": "Board", "desc": False}]}
    elif kind == "heatmap":
        # buckets computed by Grafana from the series' values: one cell per degree band and time step
        p["options"] = {"calculate": True, "calculation": {"yBuckets": {"mode": "size", "value": "2"}},
                        "cellGap": 1, "color": {"mode": "scheme", "scheme": "Oranges", "steps": 64},
                        "yAxis": {"unit": unit}, "tooltip": {"mode": "single", "yHistogram": True},
                        "legend": {"show": True}}
    else:
        p["fieldConfig"]["defaults"]["custom"] = {"lineWidth": 1, "fillOpacity": 0, "spanNulls": True}
        p["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                        "tooltip": {"mode": "multi", "sort": "desc"}}
    return p


def build() -> dict:
    panels, pid, y = [], 1, 0
    for row_title, row_panels in PANELS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"x": 0, "y": y, "w": 24, "h": 1}, "panels": []})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for kind, title, unit, description, targets, w in row_panels:
            if x + w > 24:
                x, y = 0, y + row_h
            p = panel(pid, kind, title, unit, description, targets, x, y, w)
            panels.append(p)
            pid, x, row_h = pid + 1, x + w, max(row_h, p["gridPos"]["h"])
        y += row_h
    return {
        "uid": "appliance-fleet",
        "title": "Appliance fleet",
        "description": "The fleet at a glance (decode quantiles, hottest boards, boards by state, "
                       "temperatures), then decode speed, attention, temperatures, frequency and queues "
                       "per board; the Board variable drills down.",
        "tags": ["appliance", "rk3588", "llm"],
        "timezone": "browser",
        "editable": False,
        "graphTooltip": 1,
        "refresh": "30s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-3h", "to": "now"},
        "templating": {"list": [{
            "name": "board", "label": "Board", "type": "query", "datasource": DATASOURCE,
            "query": {"query": "label_values(appliance_build_info, board)", "refId": "boards"},
            "definition": "label_values(appliance_build_info, board)",
            "refresh": 2, "multi": True, "includeAll": True, "allValue": ".+",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1,
        }]},
        "annotations": {"list": [{
            "name": "Alerts", "datasource": DATASOURCE, "enable": True, "iconColor": "red",
            "expr": f'ALERTS{{alertstate="firing", {B}}}', "titleFormat": "{{alertname}}",
            "textFormat": "{{board}}", "step": "60s",
        }]},
        "panels": panels,
    }


def main() -> int:
    text = json.dumps(build(), indent=2) + "\n"
    if "--check" in sys.argv:
        with open(OUT, encoding="utf-8") as f:
            if f.read() != text:
                print(f"{OUT} is out of date: run {sys.argv[0]}", file=sys.stderr)
                return 1
        return 0
    with open(OUT, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
