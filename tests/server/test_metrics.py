"""/metrics: promtool-clean, the series the issue names, and a real Prometheus scraping them."""
from __future__ import annotations

import shutil
import subprocess
import time

import pytest
import requests

from live_server import free_port

from appliance.weights import hugepages


def _traffic(server, model_id, n=2):
    for i in range(n):
        r = server.post("/v1/chat/completions", json={"model": model_id, "max_tokens": 6, "ignore_eos": True,
                                                      "messages": [{"role": "user", "content": f"count {i}"}]})
        assert r.status_code == 200


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool: run scripts/ci/install_server_deps.sh")
def test_promtool_check_metrics_is_clean(idle_server, model_id):
    _traffic(idle_server, model_id)
    text = requests.get(idle_server.base + "/metrics", timeout=10).text
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and not p.stdout.strip() and not p.stderr.strip(), p.stdout + p.stderr


def test_named_series_present(idle_server, model_id):
    _traffic(idle_server, model_id)
    time.sleep(0.6)                     # one thermal sample of the fake tree at least
    m = idle_server.metrics()
    names = {name for name, _ in m}
    for name in [
        "appliance_decode_token_seconds_bucket", "appliance_decode_attention_ratio_bucket",
        "appliance_decode_attention_last_ratio", "appliance_prefill_seconds_bucket",
        "appliance_time_to_first_token_seconds_bucket", "appliance_request_duration_seconds_bucket",
        "appliance_prompt_tokens_total", "appliance_generation_tokens_total", "appliance_requests_total",
        "appliance_requests_running", "appliance_requests_waiting", "appliance_kv_cache_used_blocks",
        "appliance_kv_cache_capacity_blocks", "appliance_running_context_max_tokens",
        "appliance_decode_context_tokens_bucket",
        "appliance_thermal_zone_temperature_celsius", "appliance_cpu_frequency_hertz",
        "appliance_cpu_frequency_max_hertz", "appliance_cpu_throttled", "appliance_cpu_throttled_seconds_total",
        "appliance_model_info", "appliance_build_info", "appliance_selftest_ok",
        "appliance_cpu_run_seconds_total", "appliance_cpu_wait_seconds_total",
        "appliance_kernel_pool_jobs_total", "appliance_kernel_pool_chunks_total",
        "appliance_kernel_pool_caller_sleeps_total", "appliance_kernel_pool_chunks_taken_back_total",
    ]:
        assert name in names, name
    les = sorted(float(dict(lbl)["le"]) for name, lbl in m if name == "appliance_decode_token_seconds_bucket")
    assert les[0] == 0.005 and les[-2] == 2.0                       # 5 ms .. 2 s, then +Inf
    zones = {dict(lbl)["zone"] for name, lbl in m if name == "appliance_thermal_zone_temperature_celsius"}
    assert {"soc-thermal", "bigcore0-thermal", "littlecore-thermal"} <= zones
    info = next(dict(lbl) for name, lbl in m if name == "appliance_model_info")
    assert info["model"] == model_id and info["weights"] == "q8" and info["kv"] == "q8"
    assert m[("appliance_kv_cache_capacity_blocks", ())] > 0
    assert m[("appliance_requests_total", (("outcome", "length"),))] >= 2
    # the demo model's streamed matrices sit in huge pages wherever this kernel offers them
    assert (m[("appliance_weight_hugepage_bytes", ())] > 0) == hugepages.wanted()
    assert m[("appliance_selftest_ok", ())] == 1          # the start-up selftest of this build passed
    # the server's threads ran the requests above (the kernel's schedstat of its process)
    assert m[("appliance_cpu_run_seconds_total", ())] > 0.1 and m[("appliance_cpu_wait_seconds_total", ())] >= 0
    # the kernels' pool counters (the tiny model's products are too small to run on two threads)
    assert m[("appliance_kernel_pool_chunks_total", (("thread", "caller"),))] >= 0


def test_kernel_pool_counters_are_read_at_scrape_time():
    from prometheus_client.parser import text_string_to_metric_families

    from appliance.telemetry.metrics import Metrics

    metrics = Metrics(process_metrics=False)
    text = metrics.render()[0].decode()
    assert "appliance_kernel_pool" not in text            # nothing bound: no series rather than zeros
    stats = {"jobs": 7, "caller_chunks": 40, "worker_chunks": 30, "caller_sleeps": 2, "worker_wakeups": 5,
             "taken_back": 3}
    metrics.bind(kernel_pool=lambda: stats)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render()[0].decode()) for s in family.samples}
    assert samples[("appliance_kernel_pool_jobs_total", ())] == 7
    assert samples[("appliance_kernel_pool_chunks_total", (("thread", "caller"),))] == 40
    assert samples[("appliance_kernel_pool_chunks_total", (("thread", "worker"),))] == 30
    assert samples[("appliance_kernel_pool_caller_sleeps_total", ())] == 2
    assert samples[("appliance_kernel_pool_chunks_taken_back_total", ())] == 3
    stats["taken_back"] = 4                                # read again at the next scrape
    assert "appliance_kernel_pool_chunks_taken_back_total 4.0" in metrics.render()[0].decode()


def _selftest_gauge(metrics) -> float:
    text = metrics.render()[0].decode()
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("appliance_selftest_ok ")))


@pytest.mark.parametrize("outcome", ["ok", "disagrees", "crashes"])
def test_start_up_selftest_sets_the_gauge_the_fleet_alert_reads(outcome):
    import math
    import types

    from appliance.config import Settings
    from appliance.telemetry.metrics import Metrics
    from appliance.server.runtime import Runtime

    def fake_report():
        if outcome == "crashes":
            raise ImportError("no _kernels")
        return {"ok": outcome == "ok", "kernel_path": "avx2",
                "checks": [{"name": "gemm_q8", "ok": outcome == "ok", "detail": "-"}]}

    engine = types.SimpleNamespace(kernel_selftest=fake_report)   # the engine's side is its own test
    runtime = Runtime(Settings(sysfs_root="/nonexistent"), metrics=Metrics(process_metrics=False))
    assert math.isnan(_selftest_gauge(runtime.metrics))          # no verdict before it ran
    runtime._selftest(engine)
    assert _selftest_gauge(runtime.metrics) == (1.0 if outcome == "ok" else 0.0)


def test_engine_selftest_is_the_kernels_report(tiny_qwen3_dir):
    from appliance import Engine
    from appliance.kernels.selftest import selftest_report

    report = Engine.load(tiny_qwen3_dir, progress=False).kernel_selftest()
    assert report["ok"] and {c["name"] for c in report["checks"]} == {c["name"] for c in selftest_report()["checks"]}


PROM_CONFIG = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: appliance
    metrics_path: /metrics
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("prometheus") is None, reason="prometheus: run scripts/ci/install_server_deps.sh")
def test_real_prometheus_scrapes_the_server(idle_server, model_id, tmp_path):
    _traffic(idle_server, model_id, n=3)
    (tmp_path / "prometheus.yml").write_text(PROM_CONFIG.replace("{port}", str(idle_server.port)))
    port = free_port()
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=(tmp_path / "prometheus.log").open("wb"))
    api = f"http://127.0.0.1:{port}/api/v1/query"

    def query(q):
        try:
            r = requests.get(api, params={"query": q}, timeout=5).json()
        except (requests.RequestException, ValueError):
            return []
        return r.get("data", {}).get("result", []) if r.get("status") == "success" else []

    try:
        deadline = time.monotonic() + 30
        while not query('up{job="appliance"} == 1') and time.monotonic() < deadline:
            time.sleep(0.5)
        assert query('up{job="appliance"} == 1'), (tmp_path / "prometheus.log").read_text()
        done = query('appliance_requests_total{outcome="length"}')
        assert done and float(done[0]["value"][1]) >= 3
        assert query("appliance_generation_tokens_total > 0")
        assert query("histogram_quantile(0.5, appliance_decode_token_seconds_bucket) > 0")
        assert query('appliance_thermal_zone_temperature_celsius{zone="bigcore0-thermal"}')
        assert len(query("appliance_cpu_throttled")) == 3          # policy0, policy4, policy6
        assert query("appliance_model_info") and query("appliance_kv_cache_capacity_blocks > 0")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
