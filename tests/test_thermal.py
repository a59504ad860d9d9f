"""Thermal reader and monitor on fake sysfs trees of both RK3588 kernel layouts."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "lab"))
from fake_sysfs import ZONES, make_tree, set_freq  # noqa: E402

from appliance.telemetry.thermal import ThermalMonitor, ThermalReader, zone_policies  # noqa: E402


@pytest.mark.parametrize("layout", ["vendor", "mainline"])
def test_reads_zones_and_policies(tmp_path, layout):
    root = make_tree(tmp_path, layout)
    snap = ThermalReader(str(root)).snapshot(busy_cpus=set())
    assert [z.name for z in snap.zones] == ZONES[layout]
    assert [z.temp_c for z in snap.zones] == pytest.approx([41.2 + i for i in range(len(ZONES[layout]))])
    assert {p.name: p.cpus for p in snap.policies} == {"policy0": [0, 1, 2, 3], "policy4": [4, 5],
                                                       "policy6": [6, 7]}
    big = snap.policies[1]
    assert big.cur_hz == big.max_hz == big.hw_max_hz == 2.352e9
    assert big.cluster == "cpu4-5"
    assert not snap.throttled


@pytest.mark.parametrize("layout", ["vendor", "mainline"])
def test_passive_trip_throttles_its_cluster(tmp_path, layout):
    root = make_tree(tmp_path, layout, hot_trip=True)
    snap = ThermalReader(str(root)).snapshot()
    by_name = {p.name: p for p in snap.policies}
    assert by_name["policy4"].throttled and "passive trip" in by_name["policy4"].reason
    assert not by_name["policy0"].throttled and not by_name["policy6"].throttled


def test_zone_to_cluster_mapping_both_kernels(tmp_path):
    policies = ThermalReader(str(make_tree(tmp_path))).policies()
    names = lambda zone: [p.name for p in zone_policies(zone, policies)]  # noqa: E731
    assert names("littlecore-thermal") == ["policy0"]
    assert names("bigcore0-thermal") == ["policy4"]
    assert names("bigcore1-thermal") == ["policy6"]      # vendor numbering
    assert names("bigcore2-thermal") == ["policy6"]      # mainline numbering
    assert names("soc-thermal") == names("package-thermal") == ["policy0", "policy4", "policy6"]
    assert names("gpu-thermal") == names("npu-thermal") == []


def test_frequency_held_below_max_while_busy_is_throttling(tmp_path):
    root = make_tree(tmp_path, "mainline", throttled=True)
    reader = ThermalReader(str(root))
    idle = reader.snapshot(busy_cpus=set())
    assert not idle.throttled                       # a low clock while idle is the governor, not heat
    busy = reader.snapshot(busy_cpus={4, 5, 6, 7})
    by_name = {p.name: p for p in busy.policies}
    assert by_name["policy4"].throttled and by_name["policy6"].throttled
    assert not by_name["policy0"].throttled         # the little cluster was idle
    assert by_name["policy4"].cur_hz == 1.416e9 and by_name["policy4"].hw_max_hz == 2.352e9


class _Busy:
    def __init__(self, cpus):
        self.cpus = cpus

    def busy_cpus(self):
        return self.cpus


def test_monitor_needs_two_samples_and_counts_seconds(tmp_path, monkeypatch):
    root = make_tree(tmp_path, "vendor", throttled=True)
    mon = ThermalMonitor(str(root), interval=0.5)
    mon.cpu = _Busy({4, 5})
    clock = [1000.0]
    monkeypatch.setattr("appliance.telemetry.thermal.time.monotonic", lambda: clock[0])
    first = mon.sample()
    assert not first.throttled                      # one dip could be the governor
    clock[0] += 0.5
    second = mon.sample()
    assert second.throttled and mon.throttled_since(first.time)
    clock[0] += 0.5
    mon.sample()
    assert mon.throttled_seconds["policy4"] == pytest.approx(1.0)
    assert mon.throttled_seconds["policy0"] == 0.0
    set_freq(root, "policy4", 2352000, 2352000)     # cooled down: back at full clock
    clock[0] += 0.5
    assert not {p.name: p for p in mon.sample().policies}["policy4"].throttled


def test_missing_sensor_reads_unknown(tmp_path):
    root = make_tree(tmp_path, "vendor", missing=("gpu-thermal",))
    gpu = next(z for z in ThermalReader(str(root)).zones() if z.name == "gpu-thermal")
    assert gpu.temp_c is None and not gpu.passive_crossed


def test_unreadable_and_garbage_files_read_unknown(tmp_path):
    root = make_tree(tmp_path, "mainline")
    (root / "class/thermal/thermal_zone1/temp").unlink()
    (root / "class/thermal/thermal_zone1/temp").mkdir()          # read() fails with EISDIR
    (root / "class/thermal/thermal_zone2/temp").write_text("N/A\n")
    (root / "devices/system/cpu/cpufreq/policy6/scaling_cur_freq").unlink()
    snap = ThermalReader(str(root)).snapshot(busy_cpus={6, 7})
    assert snap.zones[1].temp_c is None and snap.zones[2].temp_c is None
    p6 = snap.policies[2]
    assert p6.cur_hz is None and not p6.throttled


def test_empty_or_absent_tree(tmp_path):
    snap = ThermalReader(str(tmp_path / "nothing")).snapshot()
    assert snap.zones == [] and snap.policies == [] and not snap.throttled


def test_duplicate_zone_types_stay_distinct(tmp_path):
    root = make_tree(tmp_path, "vendor")
    (root / "class/thermal/thermal_zone6/type").write_text("gpu-thermal\n")
    names = [z.name for z in ThermalReader(str(root)).zones()]
    assert len(names) == len(set(names)) and "gpu-thermal#6" in names


def test_metrics_export_thermal(tmp_path):
    from appliance.telemetry.metrics import Metrics

    root = make_tree(tmp_path, "mainline", throttled=True, missing=("npu-thermal",))
    mon = ThermalMonitor(str(root), interval=0.5)
    mon.cpu = _Busy({4, 5, 6, 7})
    mon.sample()
    mon.sample()
    m = Metrics(process_metrics=False)
    m.bind(thermal=mon.snapshot)
    text = m.render()[0].decode()
    assert 'appliance_thermal_zone_temperature_celsius{zone="bigcore2-thermal"} 84.0' in text
    assert 'zone="npu-thermal"' not in text                        # unknown: no sample at all
    assert 'appliance_cpu_throttled{cpus="cpu4-5",policy="policy4"} 1.0' in text
    assert 'appliance_cpu_throttled{cpus="cpu0-3",policy="policy0"} 0.0' in text
    assert 'appliance_cpu_frequency_hertz{cpus="cpu6-7",policy="policy6"} 1.416e+09' in text
    assert "appliance_cpu_throttled_seconds_total" in text


def test_sensors_that_vanish_or_turn_to_garbage_mid_run_read_unknown(tmp_path, caplog):
    """The monitor's thread keeps sampling while zone and policy files disappear, hold garbage,
    nan or inf, and /proc/stat is garbled: those values are unknown (None), nothing raises."""
    import shutil
    import time as clock

    root = make_tree(tmp_path / "sys", "vendor")
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3 4\ncpu0 10 0 10 100 0\ncpu4 50 0 50 10 0\n")
    mon = ThermalMonitor(str(root), interval=0.05, proc_stat=str(stat)).start()
    try:
        first = mon.snapshot()
        deadline = clock.monotonic() + 5
        while (first is None or mon.snapshot() is first) and clock.monotonic() < deadline:
            clock.sleep(0.02)
            first = first or mon.snapshot()
        zones = root / "class/thermal"
        (zones / "thermal_zone0/temp").unlink()
        (zones / "thermal_zone1/temp").write_text("garbage\n")
        (zones / "thermal_zone2/temp").write_text("nan\n")
        (zones / "thermal_zone3/temp").write_text("inf\n")
        shutil.rmtree(zones / "thermal_zone4")
        (root / "devices/system/cpu/cpufreq/policy4/scaling_cur_freq").write_text("\x00\xff\n")
        shutil.rmtree(root / "devices/system/cpu/cpufreq/policy6")
        stat.write_text("cpu0 x y z\ncpu4\n")
        seen = mon.snapshot()
        while mon.snapshot() is seen and clock.monotonic() < deadline + 5:
            clock.sleep(0.02)
        clock.sleep(0.2)
        snap = mon.snapshot()
    finally:
        mon.stop()
    temps = {z.name: z.temp_c for z in snap.zones}
    assert temps["soc-thermal"] is None and temps["bigcore0-thermal"] is None
    assert temps["bigcore1-thermal"] is None and temps["littlecore-thermal"] is None
    assert "center-thermal" not in temps and temps["gpu-thermal"] is not None
    policies = {p.name: p for p in snap.policies}
    assert "policy6" not in policies and policies["policy4"].cur_hz is None
    assert not [r for r in caplog.records if "thermal sample failed" in r.message]
    from appliance.telemetry.metrics import Metrics
    m = Metrics(process_metrics=False)
    m.bind(thermal=mon.snapshot)
    temps = [line for line in m.render()[0].decode().splitlines()
             if line.startswith("appliance_thermal_zone_temperature_celsius{")]
    assert temps and not [line for line in temps if 'zone="soc-thermal"' in line]   # unknown: no sample
    assert all(float(line.rsplit(" ", 1)[1]) < 200 for line in temps)              # no nan, no inf
