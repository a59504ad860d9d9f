"""Fake sysfs trees of an RK3588 board, as the vendor (Rockchip BSP) and mainline kernels lay them out.

    make_tree(root, "vendor")                      cool, idle board
    make_tree(root, "mainline", throttled=True)    big cores held at 1.2 GHz of 2.4 GHz, hot
    make_tree(root, "vendor", missing=("gpu-thermal",))  that zone's temp file is absent
"""
from __future__ import annotations

from pathlib import Path

ZONES = {
    # vendor 5.10/6.1 BSP kernels: soc-thermal first, bigcore0/1
    "vendor": ["soc-thermal", "bigcore0-thermal", "bigcore1-thermal", "littlecore-thermal",
               "center-thermal", "gpu-thermal", "npu-thermal"],
    # mainline (6.x): package-thermal, bigcore0/bigcore2 (numbered by their first core pair)
    "mainline": ["package-thermal", "bigcore0-thermal", "bigcore2-thermal", "littlecore-thermal",
                 "center-thermal", "gpu-thermal", "npu-thermal"],
}
# policy -> (cpus, cpuinfo_max kHz)
POLICIES = {"policy0": ([0, 1, 2, 3], 1800000), "policy4": ([4, 5], 2400000), "policy6": ([6, 7], 2400000)}


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def make_tree(root: Path, layout: str = "vendor", *, throttled: bool = False, hot_trip: bool = False,
              missing: tuple[str, ...] = (), temps: dict[str, float] | None = None) -> Path:
    """Write the tree under `root` and return it. `throttled`: the big clusters run at half
    their max (scaling_max lowered, as cpufreq cooling does) and zones are hot; `hot_trip`:
    bigcore0 is above its passive trip point."""
    root = Path(root)
    for i, name in enumerate(ZONES[layout]):
        z = root / "class" / "thermal" / f"thermal_zone{i}"
        _write(z / "type", name)
        temp = (temps or {}).get(name, 86.5 if throttled else 41.2 + i)
        if name.startswith("bigcore0") and hot_trip:
            temp = 90.0
        if name not in missing:
            _write(z / "temp", str(int(temp * 1000)))
        _write(z / "policy", "step_wise")
        _write(z / "trip_point_0_type", "passive")
        _write(z / "trip_point_0_temp", "85000" if name.startswith("bigcore0") and hot_trip else "95000")
        _write(z / "trip_point_1_type", "critical")
        _write(z / "trip_point_1_temp", "115000")
    for name, (cpus, hw_max) in POLICIES.items():
        p = root / "devices" / "system" / "cpu" / "cpufreq" / name
        big = name != "policy0"
        cap = hw_max // 2 if throttled and big else hw_max
        _write(p / "related_cpus", " ".join(map(str, cpus)))
        _write(p / "affected_cpus", " ".join(map(str, cpus)))
        _write(p / "cpuinfo_max_freq", str(hw_max))
        _write(p / "cpuinfo_min_freq", "408000")
        _write(p / "scaling_max_freq", str(cap))
        _write(p / "scaling_cur_freq", str(cap))
    return root


def set_freq(root: Path, policy: str, cur_khz: int, max_khz: int | None = None) -> None:
    p = Path(root) / "devices" / "system" / "cpu" / "cpufreq" / policy
    _write(p / "scaling_cur_freq", str(cur_khz))
    if max_khz is not None:
        _write(p / "scaling_max_freq", str(max_khz))
