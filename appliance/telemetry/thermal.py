"""Thermal watch: thermal zones and cpufreq policies read from sysfs.

Reads, under a configurable root (APPLIANCE_SYSFS_ROOT; tests use a fake tree):
  class/thermal/thermal_zone*/type, temp (millidegrees C), trip_point_*_{type,temp}
  devices/system/cpu/cpufreq/policy*/scaling_cur_freq, scaling_max_freq,
      cpuinfo_max_freq (kHz), related_cpus | affected_cpus

RK3588 zone names differ between kernels: the vendor kernel has soc-thermal,
bigcore0-thermal, bigcore1-thermal, littlecore-thermal, center-thermal, gpu-thermal,
npu-thermal; mainline has package-thermal, bigcore0-thermal, bigcore2-thermal,
littlecore-thermal, center-thermal, gpu-thermal, npu-thermal. Zones are reported
under whatever type the kernel gives; only the zone -> CPU cluster mapping (used to
attribute a crossed passive trip point to a policy) needs to know the names.

A policy is throttled when its current frequency is held below its maximum while
its CPUs are busy (two samples in a row, so a governor's momentary dip does not
count), or when a passive trip point of a zone covering it is crossed. A sensor
that is missing or unreadable reads as None (unknown), never as an error.
"""
from __future__ import annotations

import glob
import logging
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field

log = logging.getLogger("appliance.thermal")

FREQ_TOLERANCE = 0.98        # cur >= 98% of max counts as "at max" (governor rounding)
BUSY_UTILISATION = 0.5       # a policy is busy when one of its CPUs is at least this busy


@dataclass
class TripPoint:
    kind: str                # passive | active | hot | critical
    temp_c: float


@dataclass
class ZoneReading:
    name: str                # sysfs `type`, e.g. "bigcore0-thermal" (made unique if repeated)
    index: int               # N of thermal_zoneN
    temp_c: float | None     # None: the sensor is missing or unreadable
    trips: list[TripPoint] = field(default_factory=list)

    @property
    def passive_crossed(self) -> bool:
        return self.temp_c is not None and any(
            t.kind == "passive" and self.temp_c >= t.temp_c for t in self.trips)


@dataclass
class PolicyReading:
    name: str                # "policy4"
    cpus: list[int]
    cur_hz: float | None
    max_hz: float | None     # scaling_max_freq: the limit in force (thermal cooling lowers it)
    hw_max_hz: float | None  # cpuinfo_max_freq: what the silicon can do
    busy: bool | None = None
    throttled: bool = False
    reason: str = ""

    @property
    def cluster(self) -> str:
        """A readable cluster name: "cpu4-5"."""
        if not self.cpus:
            return self.name
        return f"cpu{self.cpus[0]}-{self.cpus[-1]}" if len(self.cpus) > 1 else f"cpu{self.cpus[0]}"


@dataclass
class ThermalSnapshot:
    time: float
    zones: list[ZoneReading]
    policies: list[PolicyReading]
    # Seconds each policy has spent throttled since the monitor started (ThermalMonitor fills it).
    throttled_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def throttled(self) -> bool:
        return any(p.throttled for p in self.policies)

    def to_dict(self) -> dict:
        return {
            "time": self.time,
            "throttled": self.throttled,
            "zones": [{"zone": z.name, "temp_c": z.temp_c, "passive_crossed": z.passive_crossed}
                      for z in self.zones],
            "policies": [{"policy": p.name, "cluster": p.cluster, "cpus": p.cpus,
                          "cur_hz": p.cur_hz, "max_hz": p.max_hz, "hw_max_hz": p.hw_max_hz,
                          "busy": p.busy, "throttled": p.throttled, "reason": p.reason}
                         for p in self.policies],
        }


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read().strip()
    except OSError:          # missing file, or a sensor that answers EINVAL/ENODATA/EAGAIN
        return None


def _read_number(path: str) -> float | None:
    """A sysfs number, or None ("unknown") for a missing file, garbage, or nan/inf."""
    text = _read(path)
    if text is None:
        return None
    try:
        value = float(text.split()[0])
    except (ValueError, IndexError):
        return None
    return value if math.isfinite(value) else None


def _parse_cpus(text: str | None) -> list[int]:
    """'4 5' (related_cpus) or '4-5' (cpulist) -> [4, 5]."""
    cpus: list[int] = []
    for part in re.split(r"[\s,]+", text or ""):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            cpus.extend(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            return []
    return sorted(set(cpus))


def _index(path: str) -> int:
    m = re.search(r"(\d+)$", path.rstrip("/"))
    return int(m.group(1)) if m else 0


def zone_policies(zone: str, policies: list[PolicyReading]) -> list[PolicyReading]:
    """The cpufreq policies a zone's passive trip throttles.

    Clusters are told apart by their first CPU, in order: little cores first, then
    the big pairs. bigcore1 (vendor) and bigcore2 (mainline) both mean the second
    big pair; soc/package/cpu/center zones cover every CPU; gpu/npu zones none.
    """
    name = zone.lower()
    ordered = sorted(policies, key=lambda p: p.cpus[0] if p.cpus else _index(p.name))
    if "little" in name:
        return ordered[:1]
    m = re.search(r"big\w*?(\d+)", name)
    if m and len(ordered) > 1:
        big = ordered[1:]
        n = int(m.group(1))
        pair = 0 if n == 0 else 1          # bigcore0 -> first pair; bigcore1/bigcore2 -> second
        return big[min(pair, len(big) - 1):][:1]
    if "big" in name:
        return ordered[1:]
    if any(k in name for k in ("soc", "package", "cpu", "center", "x86_pkg")):
        return ordered
    return []


class ThermalReader:
    """Reads one snapshot of the zones and policies under `root` (default /sys)."""

    def __init__(self, root: str = "/sys"):
        self.root = root
        self.zone_dir = os.path.join(root, "class", "thermal")
        self.policy_dir = os.path.join(root, "devices", "system", "cpu", "cpufreq")

    def zones(self) -> list[ZoneReading]:
        out: list[ZoneReading] = []
        seen: dict[str, int] = {}
        paths = sorted(glob.glob(os.path.join(self.zone_dir, "thermal_zone*")), key=_index)
        for path in paths:
            index = _index(path)
            name = _read(os.path.join(path, "type")) or f"thermal_zone{index}"
            seen[name] = seen.get(name, 0) + 1
            if seen[name] > 1:
                name = f"{name}#{index}"
            millideg = _read_number(os.path.join(path, "temp"))
            trips = []
            for tpath in sorted(glob.glob(os.path.join(path, "trip_point_*_type"))):
                kind = _read(tpath)
                ttemp = _read_number(tpath[: -len("_type")] + "_temp")
                if kind and ttemp is not None:
                    trips.append(TripPoint(kind, ttemp / 1000.0))
            out.append(ZoneReading(name, index, None if millideg is None else millideg / 1000.0, trips))
        return out

    def policies(self) -> list[PolicyReading]:
        out: list[PolicyReading] = []
        for path in sorted(glob.glob(os.path.join(self.policy_dir, "policy*")), key=_index):
            def khz(name: str) -> float | None:
                v = _read_number(os.path.join(path, name))
                return None if v is None else v * 1000.0
            cpus = _parse_cpus(_read(os.path.join(path, "related_cpus"))
                               or _read(os.path.join(path, "affected_cpus")))
            out.append(PolicyReading(os.path.basename(path), cpus, khz("scaling_cur_freq"),
                                     khz("scaling_max_freq"), khz("cpuinfo_max_freq")))
        return out

    def snapshot(self, busy_cpus: set[int] | None = None, busy_all: bool = False) -> ThermalSnapshot:
        """Read everything once. `busy_cpus`: CPUs known to be busy (None = unknown);
        `busy_all`: every CPU counts as busy (the engine is decoding). Throttle decisions
        that need history are made by ThermalMonitor; this marks only the instantaneous
        facts (passive trip, frequency held below max while busy)."""
        zones = self.zones()
        policies = self.policies()
        for p in policies:
            if busy_all:
                p.busy = True
            elif busy_cpus is not None:
                p.busy = bool(set(p.cpus) & busy_cpus) if p.cpus else bool(busy_cpus)
        for z in zones:
            if z.passive_crossed:
                for p in zone_policies(z.name, policies):
                    p.throttled = True
                    p.reason = f"{z.name} passive trip"
        for p in policies:
            top = p.hw_max_hz or p.max_hz
            if not p.throttled and p.busy and p.cur_hz is not None and top:
                if p.cur_hz < FREQ_TOLERANCE * top:
                    p.throttled = True
                    p.reason = "frequency below max while busy"
        return ThermalSnapshot(time.time(), zones, policies)


class CpuBusy:
    """Per-CPU utilisation between two calls, from /proc/stat (None where unreadable)."""

    def __init__(self, proc_stat: str = "/proc/stat"):
        self.path = proc_stat
        self.last: dict[int, tuple[float, float]] = {}

    def busy_cpus(self) -> set[int] | None:
        text = _read(self.path)
        if text is None:
            return None
        now: dict[int, tuple[float, float]] = {}
        for line in text.splitlines():
            m = re.match(r"cpu(\d+)\s+(.*)", line)
            if not m:
                continue
            try:
                vals = [float(v) for v in m.group(2).split()]
                idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
            except (ValueError, IndexError):      # a garbled line: that CPU is unknown this time
                continue
            now[int(m.group(1))] = (sum(vals), idle)
        busy = set()
        for cpu, (total, idle) in now.items():
            if cpu in self.last:
                dt, di = total - self.last[cpu][0], idle - self.last[cpu][1]
                if dt > 0 and 1.0 - di / dt >= BUSY_UTILISATION:
                    busy.add(cpu)
        first = not self.last
        self.last = now
        return None if first else busy


class ThermalMonitor:
    """Background sampler: keeps the latest snapshot, a short history, and the
    seconds each policy spent throttled. Busy CPUs come from /proc/stat, so a cluster
    the engine does not use is not called throttled for idling at a low clock."""

    def __init__(self, root: str = "/sys", interval: float = 1.0, history: int = 300,
                 proc_stat: str = "/proc/stat"):
        self.reader = ThermalReader(root)
        self.interval = interval
        self.history_len = history
        self.cpu = CpuBusy(proc_stat)
        self.lock = threading.Lock()
        self.latest: ThermalSnapshot | None = None
        self.history: list[ThermalSnapshot] = []
        self.throttled_seconds: dict[str, float] = {}
        self._below_max: dict[str, int] = {}       # consecutive busy samples below max
        self._last_time: float | None = None
        self.last_throttled: float | None = None   # wall time of the latest throttled sample
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> ThermalSnapshot:
        """Take one sample now (the thread calls this; tests call it directly)."""
        snap = self.reader.snapshot(self.cpu.busy_cpus())
        now = time.monotonic()
        with self.lock:
            for p in snap.policies:
                if p.reason == "frequency below max while busy":
                    held = self._below_max.get(p.name, 0) + 1
                    self._below_max[p.name] = held
                    if held < 2:                 # one dip is the governor, two is a hold
                        p.throttled, p.reason = False, ""
                else:
                    self._below_max[p.name] = 0
            dt = 0.0 if self._last_time is None else min(now - self._last_time, 5 * self.interval)
            for p in snap.policies:
                self.throttled_seconds.setdefault(p.name, 0.0)
                if p.throttled:
                    self.throttled_seconds[p.name] += dt
            self._last_time = now
            snap.throttled_seconds = dict(self.throttled_seconds)
            if snap.throttled:
                self.last_throttled = snap.time
            self.latest = snap
            self.history.append(snap)
            del self.history[: -self.history_len]
        return snap

    def snapshot(self) -> ThermalSnapshot | None:
        with self.lock:
            return self.latest

    def throttled_since(self, t0: float) -> bool:
        """Whether any sample taken at or after wall time t0 was throttled."""
        with self.lock:
            return self.last_throttled is not None and self.last_throttled >= t0

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # a sampler must never take the server down
                log.exception("thermal sample failed")
            self._stop.wait(self.interval)

    def start(self) -> "ThermalMonitor":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="thermal", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval + 1)
