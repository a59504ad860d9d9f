"""The small programs the fleet relies on, each on its own (no namespaces needed):
the release archive, the supervisor, the fake sysfs under a real node_exporter, the
lab's rule copy, the bench table."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from conftest import ANSIBLE_DIR, MONITORING, REPO, run, tool

SUPERVISOR = ANSIBLE_DIR / "roles/supervisor/files/fleet-supervisor"


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


def test_supervisor_parses_units_like_systemd():
    sup = load_script(SUPERVISOR, "fleet_supervisor")
    assert sup.cpu_list("4-7") == {4, 5, 6, 7} and sup.cpu_list("0,2 5-6") == {0, 2, 5, 6}
    assert sup.seconds("45") == 45 and sup.seconds("2min") == 120 and sup.seconds("500ms") == 0.5


def test_supervisor_runs_restarts_and_stops_a_unit(tmp_path):
    """start (idempotent), a crash restarts it (Restart=on-failure), stop ends it."""
    units, rundir, logdir = (tmp_path / d for d in ("units", "run", "log"))
    units.mkdir()
    marker = tmp_path / "starts"
    script = tmp_path / "svc.py"
    script.write_text(
        "import os, time\n"
        f"open({str(marker)!r}, 'a').write(os.environ['GREETING'] + '\\n')\n"
        f"n = len(open({str(marker)!r}).read().splitlines())\n"
        "time.sleep(0.3 if n == 1 else 60)\n"
        "raise SystemExit(1 if n == 1 else 0)\n")
    import pwd
    user = pwd.getpwuid(os.getuid()).pw_name
    (units / "demo.service").write_text(
        "[Unit]\nDescription=demo\n\n[Service]\n"
        f"ExecStart={sys.executable} {script}\n"
        'Environment="GREETING=hello world"\n'
        f"User={user}\n"
        "Restart=on-failure\nRestartSec=0.2\nTimeoutStopSec=5\nCPUAffinity=0\n")
    env = dict(os.environ, FLEET_SUPERVISOR_UNIT_DIRS=str(units), FLEET_SUPERVISOR_RUN_DIR=str(rundir),
               FLEET_SUPERVISOR_LOG_DIR=str(logdir))

    def sup(*args):
        return subprocess.run([sys.executable, SUPERVISOR, *args], env=env, capture_output=True, text=True,
                              timeout=30)

    try:
        assert "started" in sup("start", "demo").stdout
        assert "already running" in sup("start", "demo").stdout
        deadline = time.time() + 10
        while time.time() < deadline and (not marker.exists() or len(marker.read_text().split()) < 4):
            time.sleep(0.1)
        assert marker.read_text().split() == ["hello", "world", "hello", "world"], "not restarted after a crash"
        assert sup("status", "demo").returncode == 0
        assert "stopped" in sup("stop", "demo").stdout
        assert sup("status", "demo").returncode == 3
        assert "exited rc=1" in (logdir / "demo.log").read_text()
    finally:
        sup("stop", "demo")


def test_verify_unit_rejects_unknown_keys(tmp_path):
    tool("systemd-analyze")
    good = tmp_path / "good"
    good.write_text("[Service]\nExecStart=/bin/true\n")
    bad = tmp_path / "bad"
    bad.write_text("[Service]\nExecStart=/bin/true\nNoSuchKey=1\n")
    ok = subprocess.run([sys.executable, SUPERVISOR, "verify-unit", good, "good.service"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    ko = subprocess.run([sys.executable, SUPERVISOR, "verify-unit", bad, "bad.service"], capture_output=True, text=True)
    assert ko.returncode != 0 and "NoSuchKey" in ko.stderr


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
        assert sample(text, "node_thermal_zone_temp", type="bigcore0-thermal") == 45.0
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
