#!/usr/bin/env python3
"""A fake RK3588 sysfs tree for simulated boards (no real sensors in a VM).

    fake_sysfs.py create ROOT [--governor schedutil]
    fake_sysfs.py heat ROOT [--zone bigcore0-thermal] [--celsius 95]
    fake_sysfs.py cool ROOT

The tree has what the board role, node_exporter (--path.sysfs) and the appliance's
thermal reader (APPLIANCE_SYSFS_ROOT) read:
  devices/system/cpu/cpufreq/policy{0,4,6}/   A55 x4, A76 x2, A76 x2 (frequencies in kHz)
  devices/system/cpu/cpuN/cpufreq -> ../cpufreq/policyM, cpuN/cpu_capacity
  class/thermal/thermal_zone0..6/              vendor-kernel zone names, millidegrees C,
                                               a passive trip at 85 C, critical at 115 C
  class/devfreq/dmc/                           the DDR memory controller (governor!)

`heat` does what the kernel does when a big-core zone crosses its passive trip: the
zone reads hot and the cooling device lowers that cluster's scaling_max_freq.
"""
from __future__ import annotations

import argparse
import os

# (policy, cpus, hardware max kHz, cpu_capacity)
CLUSTERS = [(0, [0, 1, 2, 3], 1800000, 414), (4, [4, 5], 2352000, 1024), (6, [6, 7], 2352000, 1024)]
ZONES = ["soc-thermal", "bigcore0-thermal", "bigcore1-thermal", "littlecore-thermal",
         "center-thermal", "gpu-thermal", "npu-thermal"]
ZONE_POLICY = {"bigcore0-thermal": 4, "bigcore1-thermal": 6, "littlecore-thermal": 0}
IDLE_MILLIDEG = 45000
THROTTLED_KHZ = 1416000
CPU_GOVERNORS = "conservative ondemand userspace powersave performance schedutil"
DMC_GOVERNORS = "dmc_ondemand userspace powersave performance simple_ondemand"


def write(path: str, value) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="ascii") as f:
        f.write(f"{value}\n")


def create(root: str, governor: str) -> None:
    cpu = os.path.join(root, "devices", "system", "cpu")
    write(os.path.join(cpu, "online"), "0-7")
    write(os.path.join(cpu, "possible"), "0-7")
    write(os.path.join(cpu, "present"), "0-7")
    for policy, cpus, max_khz, capacity in CLUSTERS:
        p = os.path.join(cpu, "cpufreq", f"policy{policy}")
        cpulist = " ".join(map(str, cpus))
        for name, value in [("affected_cpus", cpulist), ("related_cpus", cpulist),
                            ("cpuinfo_max_freq", max_khz), ("cpuinfo_min_freq", 408000),
                            ("cpuinfo_cur_freq", max_khz), ("cpuinfo_transition_latency", 40000),
                            ("scaling_cur_freq", max_khz), ("scaling_max_freq", max_khz),
                            ("scaling_min_freq", 408000), ("scaling_governor", governor),
                            ("scaling_available_governors", CPU_GOVERNORS),
                            ("scaling_driver", "cpufreq-dt"), ("scaling_setspeed", "<unsupported>")]:
            write(os.path.join(p, name), value)
        for n in cpus:
            d = os.path.join(cpu, f"cpu{n}")
            write(os.path.join(d, "cpu_capacity"), capacity)
            link = os.path.join(d, "cpufreq")
            if not os.path.islink(link):
                os.symlink(f"../cpufreq/policy{policy}", link)
    for index, name in enumerate(ZONES):
        z = os.path.join(root, "class", "thermal", f"thermal_zone{index}")
        for key, value in [("type", name), ("temp", IDLE_MILLIDEG), ("policy", "step_wise"),
                           ("mode", "enabled"), ("trip_point_0_type", "passive"),
                           ("trip_point_0_temp", 85000), ("trip_point_1_type", "critical"),
                           ("trip_point_1_temp", 115000)]:
            write(os.path.join(z, key), value)
    dmc = os.path.join(root, "class", "devfreq", "dmc")
    for key, value in [("governor", "dmc_ondemand"), ("available_governors", DMC_GOVERNORS),
                       ("cur_freq", 528000000), ("min_freq", 528000000), ("max_freq", 2112000000),
                       ("available_frequencies", "528000000 1068000000 1560000000 2112000000")]:
        write(os.path.join(dmc, key), value)


def set_zone(root: str, zone: str, millideg: int, throttle: bool) -> None:
    index = ZONES.index(zone)
    write(os.path.join(root, "class", "thermal", f"thermal_zone{index}", "temp"), millideg)
    policy = ZONE_POLICY.get(zone)
    if policy is None:
        return
    hw_max = next(c[2] for c in CLUSTERS if c[0] == policy)
    khz = THROTTLED_KHZ if throttle else hw_max
    p = os.path.join(root, "devices", "system", "cpu", "cpufreq", f"policy{policy}")
    for name in ("scaling_max_freq", "scaling_cur_freq", "cpuinfo_cur_freq"):
        write(os.path.join(p, name), khz)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["create", "heat", "cool"])
    ap.add_argument("root")
    ap.add_argument("--governor", default="schedutil", help="initial cpufreq governor (create)")
    ap.add_argument("--zone", default="bigcore0-thermal", choices=ZONES)
    ap.add_argument("--celsius", type=float, default=95.0)
    a = ap.parse_args()
    if a.action == "create":
        create(a.root, a.governor)
    elif a.action == "heat":
        set_zone(a.root, a.zone, int(a.celsius * 1000), throttle=True)
    else:
        set_zone(a.root, a.zone, IDLE_MILLIDEG, throttle=False)


if __name__ == "__main__":
    main()
