#!/usr/bin/env python3
"""A fake RK3588 sysfs tree: the simulated lab boards (no real sensors in a container) and the
thermal tests read it. Standard library only: the lab runs it with the host's python3.

    fake_sysfs.py create ROOT [--layout vendor|mainline] [--governor schedutil]
    fake_sysfs.py heat ROOT [--zone bigcore0-thermal] [--celsius 95]
    fake_sysfs.py cool ROOT [--zone bigcore0-thermal]

From Python: make_tree(root, "mainline", throttled=True), set_zone(...), set_freq(...).

The tree has what the board role, node_exporter (--path.sysfs) and the appliance's thermal
reader (--sysfs-root) read:
  devices/system/cpu/cpufreq/policy{0,4,6}/   A55 x4, A76 x2, A76 x2 (frequencies in kHz)
  devices/system/cpu/cpuN/cpufreq -> ../cpufreq/policyM, cpuN/cpu_capacity
  class/thermal/thermal_zone0..6/              zone names of the vendor (Rockchip BSP) or the
                                               mainline kernel, millidegrees C, a passive trip
                                               at 85 C and a critical one at 115 C (the dts's)
  class/devfreq/dmc/                           the DDR memory controller (governor!)

`heat` does what the kernel does when a big-core zone crosses its passive trip: the zone reads
hot and the cooling device lowers that cluster's scaling_max_freq.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

# (policy, cpus, hardware max kHz, cpu_capacity)
CLUSTERS = [(0, [0, 1, 2, 3], 1800000, 414), (4, [4, 5], 2352000, 1024), (6, [6, 7], 2352000, 1024)]
ZONES = {
    # vendor 5.10/6.1 BSP kernels: soc-thermal first, bigcore0/1
    "vendor": ["soc-thermal", "bigcore0-thermal", "bigcore1-thermal", "littlecore-thermal",
               "center-thermal", "gpu-thermal", "npu-thermal"],
    # mainline (6.x): package-thermal, bigcore0/bigcore2 (numbered by their first core pair)
    "mainline": ["package-thermal", "bigcore0-thermal", "bigcore2-thermal", "littlecore-thermal",
                 "center-thermal", "gpu-thermal", "npu-thermal"],
}
ZONE_POLICY = {"bigcore0-thermal": 4, "bigcore1-thermal": 6, "bigcore2-thermal": 6, "littlecore-thermal": 0}
IDLE_MILLIDEG = 41200            # zone i idles at this + i degrees: a mixed-up zone shows
HOT_TRIP_MILLIDEG = 90000        # above the passive trip (85 C)
WARM_MILLIDEG = 84000            # a busy, throttled board just under its passive trip
PASSIVE_TRIP_MILLIDEG = 85000
THROTTLED_KHZ = 1416000          # what cpufreq cooling holds a hot A76 cluster at
CPU_GOVERNORS = "conservative ondemand userspace powersave performance schedutil"
DMC_GOVERNORS = "dmc_ondemand userspace powersave performance simple_ondemand"


def write(path, value) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="ascii") as f:
        f.write(f"{value}\n")


def _hw_max(policy: int) -> int:
    return next(c[2] for c in CLUSTERS if c[0] == policy)


def _zone_dir(root, index: int) -> str:
    return os.path.join(root, "class", "thermal", f"thermal_zone{index}")


def _policy_dir(root, policy) -> str:
    name = policy if str(policy).startswith("policy") else f"policy{policy}"
    return os.path.join(root, "devices", "system", "cpu", "cpufreq", name)


def idle_millideg(index: int) -> int:
    return IDLE_MILLIDEG + 1000 * index


def make_tree(root, layout: str = "vendor", *, governor: str = "schedutil", throttled: bool = False,
              hot_trip: bool = False, missing: tuple[str, ...] = (),
              temps: dict[str, float] | None = None) -> Path:
    """Write the tree under `root` and return it. `throttled`: every zone warm and both A76
    clusters held at THROTTLED_KHZ (as cpufreq cooling does); `hot_trip`: bigcore0 is above its
    passive trip point; `missing`: those zones have no temp file; `temps`: zone -> Celsius."""
    cpu = os.path.join(root, "devices", "system", "cpu")
    for name in ("online", "possible", "present"):
        write(os.path.join(cpu, name), "0-7")
    for policy, cpus, max_khz, capacity in CLUSTERS:
        cur = THROTTLED_KHZ if throttled and policy != 0 else max_khz
        cpulist = " ".join(map(str, cpus))
        for name, value in [("affected_cpus", cpulist), ("related_cpus", cpulist),
                            ("cpuinfo_max_freq", max_khz), ("cpuinfo_min_freq", 408000),
                            ("cpuinfo_cur_freq", cur), ("cpuinfo_transition_latency", 40000),
                            ("scaling_cur_freq", cur), ("scaling_max_freq", cur),
                            ("scaling_min_freq", 408000), ("scaling_governor", governor),
                            ("scaling_available_governors", CPU_GOVERNORS),
                            ("scaling_driver", "cpufreq-dt"), ("scaling_setspeed", "<unsupported>")]:
            write(os.path.join(_policy_dir(root, policy), name), value)
        for n in cpus:
            d = os.path.join(cpu, f"cpu{n}")
            write(os.path.join(d, "cpu_capacity"), capacity)
            link = os.path.join(d, "cpufreq")
            if not os.path.islink(link):
                os.symlink(f"../cpufreq/policy{policy}", link)
    for index, name in enumerate(ZONES[layout]):
        millideg = WARM_MILLIDEG if throttled else idle_millideg(index)
        if hot_trip and name == "bigcore0-thermal":
            millideg = HOT_TRIP_MILLIDEG
        if temps and name in temps:
            millideg = int(temps[name] * 1000)
        for key, value in [("type", name), ("temp", millideg), ("policy", "step_wise"),
                           ("mode", "enabled"), ("trip_point_0_type", "passive"),
                           ("trip_point_0_temp", PASSIVE_TRIP_MILLIDEG), ("trip_point_1_type", "critical"),
                           ("trip_point_1_temp", 115000)]:
            if not (key == "temp" and name in missing):
                write(os.path.join(_zone_dir(root, index), key), value)
    dmc = os.path.join(root, "class", "devfreq", "dmc")
    for key, value in [("governor", "dmc_ondemand"), ("available_governors", DMC_GOVERNORS),
                       ("cur_freq", 528000000), ("min_freq", 528000000), ("max_freq", 2112000000),
                       ("available_frequencies", "528000000 1068000000 1560000000 2112000000")]:
        write(os.path.join(dmc, key), value)
    return Path(root)


def set_freq(root, policy, cur_khz: int, max_khz: int | None = None) -> None:
    """A cluster's clock: scaling_cur_freq (and scaling_max_freq when given), in kHz."""
    p = _policy_dir(root, policy)
    for name in ("scaling_cur_freq", "cpuinfo_cur_freq"):
        write(os.path.join(p, name), cur_khz)
    if max_khz is not None:
        write(os.path.join(p, "scaling_max_freq"), max_khz)


def set_zone(root, zone: str, millideg: int | None, throttle: bool) -> None:
    """Set a zone's temperature (None: its idle one); `throttle` lowers (or restores) the cluster it cools."""
    names = [z for z in os.listdir(os.path.join(root, "class", "thermal"))]
    index = next(int(d[len("thermal_zone"):]) for d in names
                 if open(os.path.join(root, "class", "thermal", d, "type")).read().strip() == zone)
    write(os.path.join(_zone_dir(root, index), "temp"), idle_millideg(index) if millideg is None else millideg)
    policy = ZONE_POLICY.get(zone)
    if policy is not None:
        khz = THROTTLED_KHZ if throttle else _hw_max(policy)
        set_freq(root, policy, khz, khz)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["create", "heat", "cool"])
    ap.add_argument("root")
    ap.add_argument("--layout", default="vendor", choices=sorted(ZONES), help="zone names (create)")
    ap.add_argument("--governor", default="schedutil", help="initial cpufreq governor (create)")
    ap.add_argument("--zone", default="bigcore0-thermal", choices=sorted(set(ZONES["vendor"] + ZONES["mainline"])))
    ap.add_argument("--celsius", type=float, default=95.0)
    a = ap.parse_args()
    if a.action == "create":
        make_tree(a.root, a.layout, governor=a.governor)
    elif a.action == "heat":
        set_zone(a.root, a.zone, int(a.celsius * 1000), throttle=True)
    else:
        set_zone(a.root, a.zone, None, throttle=False)


if __name__ == "__main__":
    main()
