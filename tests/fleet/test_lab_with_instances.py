"""A board with several models, on the simulated fleet (tests/fleet/fleetlab.py; runs after
the other lab tests, since it leaves board1 with two instances): board1 runs a chat and an
embedding instance, both reached through the one address by the `model` a request names,
Prometheus scrapes each instance, and bench.yml measures the embedding instance."""
from __future__ import annotations

import json
import re

import pytest
import yaml

from fleetlab import API_KEY, BOARDS, LAB_DIR, LB, need
from test_lab import assert_no_request_failed
from test_lab_routing import post

pytestmark = [pytest.mark.fleet, pytest.mark.slow]

EMBED = {"name": "embed", "port": 8081, "task": "embed", "served_model_name": "lab-embed", "cpu_affinity": "1",
         "threads": 1, "kv_cache_memory": "64M", "memory_high": "900M", "memory_max": "1G"}


def test_a_board_runs_a_chat_and_an_embedding_instance_both_reached_by_model(lab):
    """An operator gives board1 a second model (host_vars, a second inventory source here) and
    re-runs site.yml: board1 drains, its appliance.service becomes appliance@chat and
    appliance@embed on their own cores, the balancer routes by model, and streams through
    it see no failure meanwhile."""
    need("site")
    override = LAB_DIR / "instances"
    (override / "host_vars").mkdir(parents=True)
    (override / "hosts.yml").write_text("all:\n  children:\n    boards:\n      hosts:\n        board1: {}\n")
    (override / "host_vars" / "board1.yml").write_text(yaml.safe_dump({"appliance_instances": [
        {"name": "chat", "port": 8080, "cpu_affinity": "0", "threads": 1}, EMBED]}))
    rc, out, stats = lab.playbook_under_load("instances-client", "site.yml", "-e",
                                             f"appliance_source_dir={LAB_DIR / 'src-v2'}",
                                             inventories=[override / "hosts.yml"])
    assert rc == 0, out[-8000:]
    assert_no_request_failed(stats, 20)
    flat = " ".join(out.split())
    assert "removed: appliance.service (in service: drained first)" in flat, out[-6000:]

    units = {u: lab.unit("board1", u, "ActiveState", "CPUAffinity", "MemoryMax", "User", "Slice")
             for u in ("appliance@chat.service", "appliance@embed.service")}
    assert {u: v["ActiveState"] for u, v in units.items()} == dict.fromkeys(units, "active"), units
    assert {u: v["Slice"] for u, v in units.items()} == dict.fromkeys(units, "appliance.slice"), units
    assert units["appliance@chat.service"]["CPUAffinity"] == "0" and units["appliance@embed.service"]["CPUAffinity"] == "1"
    assert units["appliance@embed.service"]["MemoryMax"] == str(1 << 30)
    assert lab.unit("board1", "appliance.service", "LoadState")["LoadState"] == "not-found"

    code, body = lab.get(f"{LB}/v1/models", {"Authorization": f"Bearer {API_KEY}"})
    assert code == 200, body[:300]
    ids = [m["id"] for m in json.loads(body)["data"]]
    assert "lab-embed" in ids and len(ids) == len(set(ids)) >= 2, ids
    chat_model = next(i for i in ids if i != "lab-embed")
    assert lab.get(f"{LB}/v1/models")[0] == 401, "the key is still required through the router"

    code, answer = post(lab, "/v1/embeddings", {"model": "lab-embed", "input": ["the fan of board1", "a heatsink"]})
    assert code == 200 and answer["model"] == "lab-embed" and len(answer["data"]) == 2, answer
    assert len(answer["data"][0]["embedding"]) > 8
    code, answer = post(lab, "/v1/chat/completions", {"model": chat_model, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "Hello"}]})
    assert code == 200 and answer["model"] == chat_model, answer
    code, answer = post(lab, "/v1/chat/completions", {"model": "lab-embed", "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "Hello"}]})
    assert code == 400 and answer["error"]["code"] == "unsupported_task", \
        f"a chat call naming the embedding model must reach it and be refused there: {code} {answer}"
    code, health = lab.get(f"{LB}/boards/board1/embed/health")
    assert code == 200 and json.loads(health)["status"] == "ready", health[:300]
    code, stats = lab.get(f"{LB}/boards/board1/embed/dashboard/stats")
    assert code == 200, stats[:300]
    rows = {label: value for label, value, _ in json.loads(stats)["rows"]["settings"]}
    assert rows["Instances on this board"].startswith("chat on port 8080: "), rows
    assert "embed on port 8081: embed, lab-embed (this one)" in rows["Instances on this board"], rows

    # Prometheus finds both instances in its file_sd targets (no reload) and scrapes each one
    lab.wait_for("Prometheus scraping board1's two instances", lambda: {
        r["metric"].get("instance_name"): r["value"][1]
        for r in lab.query('up{job="appliance", board="board1"}')} == {"chat": "1", "embed": "1"}, timeout=180)
    served = {r["metric"]["instance_name"]: r["metric"]["task"]
              for r in lab.query('appliance_served_model_info{board="board1", served_name="lab-embed"}')}
    assert served == {"embed": "embed"}, served
    ready = lab.query("fleet:appliance_boards_ready:count")
    assert ready and float(ready[0]["value"][1]) <= len(BOARDS), ready   # board1 counted once

    out_dir = LAB_DIR / "bench-instances"
    rc, out = lab.playbook("bench.yml", "-e", "fleet_bench_context=32", "-e", "fleet_bench_gen=4",
                           "-e", "fleet_bench_retrieval_inputs=4", "-e", "fleet_bench_retrieval_words=16",
                           "-e", "fleet_bench_retrieval_rounds=1", "-e", f"fleet_bench_output_dir={out_dir}",
                           inventories=[override / "hosts.yml"])
    assert rc == 0, out[-6000:]
    table = (out_dir / "fleet-bench.md").read_text()
    assert re.search(r"^\| embed \| board1 \| embed \| lab-embed \| 4 x 16 words \| [0-9.]+ \|$", table, re.M), table
