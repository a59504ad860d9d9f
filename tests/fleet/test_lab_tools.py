"""The small programs the fleet relies on, each on its own (no namespaces needed):
the release archive, the load balancer's drain state, the fake sysfs under a real
node_exporter, the lab's rule copy, its client loop and webhook recorder, the bench table."""
from __future__ import annotations

import base64
import importlib.machinery
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

from conftest import ANSIBLE_DIR, MONITORING, REPO, run, tool

DRAIN_STATE = ANSIBLE_DIR / "roles/loadbalancer/filter_plugins/drain_state.py"


def load_script(path, name):
    loader = importlib.machinery.SourceFileLoader(name, str(path))
    spec = importlib.util.spec_from_loader(name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def archive(source, cache):
    proc = run([sys.executable, ANSIBLE_DIR / "roles/appliance/files/source_archive.py", source, cache,
                "pyproject.toml", "setup.py", "appliance", "kernels", "missing-entry"])
    return json.loads(proc.stdout)


def test_release_archive_is_reproducible_and_leaves_out_build_products(tmp_path):
    src = tmp_path / "src"
    (src / "appliance").mkdir(parents=True)
    (src / "kernels").mkdir()
    (src / "pyproject.toml").write_text('[project]\nname = "appliance"\nversion = "1"\n')
    (src / "setup.py").write_text("")
    (src / "appliance" / "__init__.py").write_text("")
    (src / "kernels" / "k.pyx").write_text("")
    (src / "kernels" / "k.c").write_text("generated")          # Cython output: left out
    (src / "appliance" / "_k.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (src / "appliance" / "__pycache__").mkdir()
    (src / "appliance" / "__pycache__" / "x.pyc").write_bytes(b"")
    first = archive(src, tmp_path / "cache")
    assert first["changed"] and first["files"] == 4
    os.utime(src / "setup.py", (0, 0))                          # times do not matter
    again = archive(src, tmp_path / "cache")
    assert again["release"] == first["release"] and not again["changed"]
    (src / "pyproject.toml").write_text('[project]\nname = "appliance"\nversion = "2"\n')
    upgraded = archive(src, tmp_path / "cache")
    assert upgraded["release"] != first["release"] and upgraded["changed"]


def slurped(state) -> dict:
    if state is None:
        return {"failed": True, "msg": "file not found: /var/lib/appliance-loadbalancer/drained.json",
                "loadbalancer_target": "lb"}
    return {"content": base64.b64encode(json.dumps(state).encode()).decode(), "loadbalancer_target": "lb"}


def test_drain_state_keeps_what_the_operator_drained_and_returns_what_a_rollout_drained():
    ds = load_script(DRAIN_STATE, "drain_state")
    fresh = ds.drain_states([slurped(None)], {"lb": []}, now=100)
    assert fresh == {"lb": {}} and ds.read_states([slurped(None)]) == {"lb": None}
    drained = ds.drain_states([slurped({})], {"lb": ["board3"]}, drain=["board1"], now=100)["lb"]
    assert drained == {"board1": {"since": 100, "by": "rollout"}, "board3": {"since": 100, "by": "operator"}}
    later = ds.drain_states([slurped(drained)], {"lb": ["board3"]}, drain=["board1"], now=500)["lb"]
    assert later == drained, "a board already out keeps the time it left"
    back = ds.drain_states([slurped(drained)], {"lb": ["board3"]}, undrain=["board1", "board3"], now=600)["lb"]
    assert back == {"board3": {"since": 100, "by": "operator"}}, "a rollout never returns the operator's boards"
    released = ds.drain_states([slurped(back)], {"lb": []}, now=700)["lb"]
    assert released == {}, "the operator's board comes back when it leaves loadbalancer_drained"
    from ansible.errors import AnsibleFilterError
    with pytest.raises(AnsibleFilterError, match="list of board names"):
        ds.drain_states([slurped({})], {"lb": []}, drain="board1")
    with pytest.raises(AnsibleFilterError, match="not JSON"):
        ds.drain_states([{"content": base64.b64encode(b"{oops").decode(), "loadbalancer_target": "lb"}], {})
    with pytest.raises(AnsibleFilterError, match="cannot read"):
        ds.drain_states([{"failed": True, "msg": "Permission denied", "loadbalancer_target": "lb"}], {})


def test_client_loop_counts_a_stream_the_server_stopped_as_cut():
    client = load_script(REPO / "scripts/lab/client_loop.py", "client_loop")
    chunk = 'data: {"choices":[{"delta":{"content":"x"},"finish_reason":null}]}'
    whole = [chunk] * 3 + ['data: {"choices":[{"delta":{},"finish_reason":"length"}]}',
                           'data: {"choices":[],"usage":{"completion_tokens":3}}', "data: [DONE]"]
    assert client.check_stream(whole, 3) == 3
    stopped = [chunk, 'data: {"error":{"code":"shutdown","message":"the server stopped"}}', "data: [DONE]"]
    with pytest.raises(client.Cut, match="shutdown"):
        client.check_stream(stopped, 3)
    with pytest.raises(client.Cut, match="without \\[DONE\\]"):
        client.check_stream([chunk, chunk], 3)
    with pytest.raises(client.Cut, match="2 of 3"):
        client.check_stream([chunk, chunk, 'data: {"choices":[{"delta":{},"finish_reason":"length"}]}',
                             'data: {"choices":[],"usage":{"completion_tokens":2}}', "data: [DONE]"], 3)
    with pytest.raises(client.Cut, match="stop"):
        client.check_plain(b'{"choices":[{"finish_reason":"stop"}],"usage":{"completion_tokens":1}}', 3)


def test_webhook_receiver_records_each_notification(tmp_path):
    port = free_port()
    proc = subprocess.Popen([sys.executable, REPO / "scripts/lab/webhook_receiver.py", "--port", str(port),
                             "--dir", tmp_path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        for n in (1, 2):
            body = json.dumps({"status": "firing", "alerts": [{"labels": {"alertname": f"A{n}"}}]}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/team", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            assert urllib.request.urlopen(req, timeout=5).status == 200
        lines = [json.loads(l) for l in (tmp_path / "team.jsonl").read_text().splitlines()]
        assert [l["payload"]["alerts"][0]["labels"]["alertname"] for l in lines] == ["A1", "A2"]
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/../x", data=b"{}", method="POST"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_rootfs_check_reports_a_missing_tree(tmp_path):
    proc = subprocess.run([REPO / "scripts/lab/build_rootfs.sh", tmp_path / "rootfs", "--check"], capture_output=True,
                          text=True)
    assert proc.returncode == 1 and "missing or stale" in proc.stderr


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def sample(text, name, **labels):
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_node_exporter_reads_the_fake_rk3588_sysfs_and_sees_the_heat(tmp_path):
    exporter = tool("prometheus-node-exporter")
    root = tmp_path / "sysfs"
    fake = REPO / "scripts/lab/fake_sysfs.py"
    run([sys.executable, fake, "create", root])
    port = free_port()
    proc = subprocess.Popen([exporter, f"--web.listen-address=127.0.0.1:{port}", f"--path.sysfs={root}",
                             "--collector.disable-defaults", "--collector.thermal_zone", "--collector.cpufreq"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(50):
            try:
                text = scrape(port)
                break
            except OSError:
                time.sleep(0.1)
        assert sample(text, "node_thermal_zone_temp", type="bigcore0-thermal") == 42.2   # zone 1 idles at 42.2
        assert sample(text, "node_cpu_scaling_frequency_max_hertz", cpu="4") == 2.352e9
        run([sys.executable, fake, "heat", root])
        text = scrape(port)
        assert sample(text, "node_thermal_zone_temp", type="bigcore0-thermal") == 95.0
        assert sample(text, "node_cpu_scaling_frequency_max_hertz", cpu="4") == 1.416e9
        assert sample(text, "node_cpu_scaling_frequency_max_hertz", cpu="6") == 2.352e9
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_governor_script_pins_cpufreq_and_ddr_once(tmp_path):
    """The board role's script, rendered for the fake tree: sets, then reports nothing."""
    jinja2 = pytest.importorskip("jinja2")
    root = tmp_path / "sysfs"
    run([sys.executable, REPO / "scripts/lab/fake_sysfs.py", "create", root])
    template = (ANSIBLE_DIR / "roles/board/templates/board-performance.sh.j2").read_text()
    script = tmp_path / "board-performance"
    script.write_text(jinja2.Template(template, trim_blocks=True).render(
        ansible_managed="test", board_sysfs_root=str(root), board_cpu_governor="performance",
        board_devfreq_governor="performance", board_devfreq_devices=["dmc"]))
    first = run(["sh", script]).stdout
    assert first.count("set ") == 4                       # 3 cpufreq policies + the DDR controller
    assert (root / "class/devfreq/dmc/governor").read_text().strip() == "performance"
    assert run(["sh", script]).stdout == ""


def test_lab_rules_only_shorten_for(tmp_path):
    run([sys.executable, REPO / "scripts/lab/fast_rules.py", MONITORING / "prometheus/rules", tmp_path, "--for", "7s"])
    for original in (MONITORING / "prometheus/rules").glob("*.yml"):
        a = yaml.safe_load(original.read_text())
        b = yaml.safe_load((tmp_path / original.name).read_text())
        for ga, gb in zip(a["groups"], b["groups"]):
            for ra, rb in zip(ga["rules"], gb["rules"]):
                assert {k: v for k, v in ra.items() if k != "for"} == {k: v for k, v in rb.items() if k != "for"}
                if ra.get("for") not in (None, "0m"):
                    assert rb["for"] == "7s"


def test_bench_table_gathers_every_board(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    row = {"context": 128, "decode_ms_per_token": 25.0, "attn_share": 0.125, "prefill_tokens_per_s": 900.0}
    for board, ms in (("board1", 25.0), ("board2", 50.0)):
        (raw / f"{board}.json").write_text(json.dumps(
            {"exact": {"engine": {}, "rows": [dict(row, decode_ms_per_token=ms), dict(row, context=1024)]}}))
    out = tmp_path / "fleet.md"
    text = run([sys.executable, ANSIBLE_DIR / "files/bench_table.py", raw, out]).stdout
    assert out.read_text() == text
    lines = [l for l in text.splitlines() if l.startswith("| 128 ")]
    assert lines == ["| 128 | board1 | exact | 25.0 | 40.0 | 12% | 900 |",
                     "| 128 | board2 | exact | 50.0 | 20.0 | 12% | 900 |"]


def test_bench_table_adds_embeddings_and_rerank_pairs_per_second(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    row = {"context": 32, "decode_ms_per_token": 10.0}
    (raw / "board1.json").write_text(json.dumps({"exact": {"rows": [row]}, "retrieval": [
        {"instance": "embed", "task": "embed", "model": "e5", "inputs": 16, "words": 96, "per_second": 41.25},
        {"instance": "rank", "task": "rerank", "model": "r", "inputs": 16, "words": 96, "per_second": 9.5}]}))
    (raw / "board2.json").write_text(json.dumps({"exact": {"rows": [row]}}))
    text = run([sys.executable, ANSIBLE_DIR / "files/bench_table.py", raw, tmp_path / "fleet.md"]).stdout
    assert "| 32 | board2 | exact | 10.0 |" in text
    assert "| embed | board1 | embed | e5 | 16 x 96 words | 41.2 |" in text
    assert "| rerank | board1 | rank | r | 16 x 96 words | 9.5 |" in text


def load_filter(role: str, module: str):
    return load_script(ANSIBLE_DIR / "roles" / role / "filter_plugins" / f"{module}.py", f"{role}_{module}")


SINGLE = {"task": None, "port": 8080, "model_name": "", "model_files": [], "served_model_name": None, "threads": 4,
          "cpu_affinity": "4-7", "kv_cache_memory": None, "max_batch": 8, "max_queue": 16, "max_context": None,
          "memory_high": "80%", "memory_max": "90%"}


def test_one_instance_by_default_and_one_template_unit_instance_per_listed_model():
    from ansible.errors import AnsibleFilterError
    instances = load_filter("appliance", "instances")
    (one,) = instances.instance_list([], SINGLE, "/etc/appliance")
    assert (one["unit"], one["settings"], one["port"], one["cpu_affinity"]) == (
        "appliance.service", "/etc/appliance/appliance.yml", 8080, "4-7")
    chat, embed = instances.instance_list(
        [{"name": "chat", "port": 8080, "cpu_affinity": "4-6", "threads": 3},
         {"name": "embed", "port": 8081, "task": "embed", "cpu_affinity": "7", "threads": 1,
          "kv_cache_memory": "256M", "model_name": "Qwen3-Embedding-0.6B",
          "model_files": [{"name": "1_Pooling/config.json", "sha256": "ab"}]}], SINGLE, "/etc/appliance", "/var/kv")
    assert (chat["unit"], chat["settings"], chat["threads"], chat["kv_cache_memory"], chat["kv_cache_dir"]) == (
        "appliance@chat.service", "/etc/appliance/instances/chat.yml", 3, None, "/var/kv/chat")
    assert embed["dropin"] == "/etc/systemd/system/appliance@embed.service.d/instance.conf"
    assert (embed["task"], embed["cpu_affinity"], embed["memory_max"]) == ("embed", "7", "90%")
    files = instances.model_files([chat, embed])
    assert files == [{"model": "Qwen3-Embedding-0.6B", "name": "1_Pooling/config.json", "sha256": "ab",
                      "subdir": "Qwen3-Embedding-0.6B/1_Pooling"}]
    for bad, why in [([{"name": "a", "port": 1}, {"name": "b", "port": 1}], "taken"),
                     ([{"name": "a", "port": 1}, {"name": "a", "port": 2}], "twice"),
                     ([{"name": "A b", "port": 1}], "lower-case"),
                     ([{"name": "a", "port": 1, "task": "score"}], "task"),
                     ([{"name": "a", "port": 1, "gpu": 1}], "unknown keys"),
                     ([{"name": "a"}], "port")]:
        with pytest.raises(AnsibleFilterError, match=why):
            instances.instance_list(bad, SINGLE, "/etc/appliance")


def test_a_release_build_runs_on_the_cpus_no_instance_serves_on():
    from ansible.errors import AnsibleFilterError
    instances = load_filter("appliance", "instances")
    left = instances.cpus_left
    (one,) = instances.instance_list([], SINGLE, "/etc/appliance")
    assert left([one], 8) == "0-3"                     # an RK3588: the A55, off the A76's 4-7
    assert left([one], 4) == "0-3"                     # affinity past the CPUs there are
    assert left([dict(one, cpu_affinity="0-1")], 2) == ""  # nothing left: the build goes anywhere
    chat_embed = instances.instance_list([{"name": "chat", "port": 8080, "cpu_affinity": "4-6"},
                                          {"name": "embed", "port": 8081, "cpu_affinity": "1, 7"}],
                                         SINGLE, "/etc/appliance")
    assert left(chat_embed, 8) == "0,2-3"
    assert left([dict(one, cpu_affinity="")], 3) == "0-2"
    for bad in ("4-x", "7-4", "-1"):
        with pytest.raises(AnsibleFilterError, match="CPU list"):
            left([dict(one, cpu_affinity=bad)], 8)


def test_the_load_balancer_routes_by_task_and_by_model():
    routes = load_filter("loadbalancer", "routes").routes
    single = {"board2": {"ansible_host": "10.0.0.12"}, "board3": {"ansible_host": "10.0.0.13"}}
    plain = routes(sorted(single), single, 8080)
    assert plain == {"upstreams": {"appliance_boards": [
        {"board": "board2", "address": "10.0.0.12", "port": 8080, "instance": ""},
        {"board": "board3", "address": "10.0.0.13", "port": 8080, "instance": ""}]},
        "tasks": {"chat": "appliance_boards"}, "models": {}, "by_model": False}
    hostvars = dict(single, board1={"ansible_host": "10.0.0.11", "appliance_instances": [
        {"name": "chat", "port": 8080},
        {"name": "big", "port": 8082, "model_name": "Qwen3-8B"},
        {"name": "embed", "port": 8081, "task": "embed", "served_model_name": "emb,emb-alias"}]})
    got = routes(sorted(hostvars), hostvars, 8080)
    assert [s["board"] + ":" + str(s["port"]) for s in got["upstreams"]["appliance_boards"]] == [
        "board1:8080", "board1:8082", "board2:8080", "board3:8080"]
    assert got["tasks"] == {"chat": "appliance_boards", "embed": "appliance_embed"}
    assert got["models"] == {"Qwen3-8B": "appliance_model_qwen3_8b", "emb": "appliance_embed",
                             "emb-alias": "appliance_embed"}
    assert [s["port"] for s in got["upstreams"]["appliance_model_qwen3_8b"]] == [8082]
    assert got["by_model"] is True


def test_retrieval_bench_measures_each_embedding_and_rerank_instance(tmp_path):
    """Against a stand-in server answering the two endpoints' shapes: one row per retrieval
    instance (chat ones left out), the key read from stdin and sent as a bearer token."""
    import http.server
    import threading
    seen = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((self.path, self.headers.get("Authorization")))
            if self.path == "/v1/embeddings":
                answer = {"model": "emb", "data": [{"embedding": [0.1]} for _ in body["input"]]}
            else:
                answer = {"model": "rank", "results": [{"index": i, "relevance_score": 0.5}
                                                       for i in range(len(body["documents"]))]}
            data = json.dumps(answer).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    instances = tmp_path / "instances.json"
    instances.write_text(json.dumps([{"name": "chat", "unit": "appliance@chat.service", "port": 1, "task": "chat"},
                                     {"name": "embed", "unit": "appliance@embed.service", "port": port, "task": "embed"},
                                     {"name": "rank", "unit": "appliance@rank.service", "port": port, "task": "rerank"}]))
    try:
        proc = subprocess.run([sys.executable, ANSIBLE_DIR / "files/retrieval_bench.py", instances, "--inputs", "4",
                               "--words", "8", "--rounds", "2", "--api-key-stdin"], input="sekrit-key\n",
                              capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["retrieval"]
    assert [(r["instance"], r["task"], r["model"], r["inputs"]) for r in rows] == [
        ("embed", "embed", "emb", 4), ("rank", "rerank", "rank", 4)]
    assert all(r["per_second"] > 0 for r in rows)
    assert len(seen) == 2 * 3 and {auth for _, auth in seen} == {"Bearer sekrit-key"}
