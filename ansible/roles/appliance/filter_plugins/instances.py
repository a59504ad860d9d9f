"""The appliance instances a board runs, as a filter: one per model.

appliance_instances empty: one instance from the role's single-instance variables, run as
appliance.service with the settings file <config dir>/appliance.yml (the layout of a board
with one model). Otherwise one instance per entry, each the systemd template unit's
instance appliance@<name>.service with its own settings file <config dir>/instances/<name>.yml,
port, threads, CPU set, memory limits and KV budget; what an entry leaves out comes from the
single-instance variables.
"""
from __future__ import annotations

import re

from ansible.errors import AnsibleFilterError

TASKS = ("chat", "embed", "rerank")
# Entry keys, each defaulting to the role variable appliance_<key>.
INHERITED = ("task", "model_name", "model_files", "served_model_name", "threads", "cpu_affinity",
             "kv_cache_memory", "max_batch", "max_queue", "max_context", "memory_high", "memory_max")
KEYS = ("name", "port", *INHERITED)
NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}$")


def instance_list(instances, defaults: dict, config_dir: str, kv_cache_dir=None) -> list[dict]:
    """Every instance with all its fields, validated; defaults holds the single-instance
    variables (task, port, model_name, ...) without their appliance_ prefix."""
    if not instances:
        return [dict({k: defaults.get(k) for k in KEYS}, name="", unit="appliance.service",
                     settings=f"{config_dir}/appliance.yml", dropin="", kv_cache_dir=kv_cache_dir or None)]
    if not isinstance(instances, list):
        raise AnsibleFilterError(f"appliance_instances must be a list of {{name, port, ...}}, not {instances!r}")
    out, ports = [], {}
    for n, entry in enumerate(instances):
        if not isinstance(entry, dict):
            raise AnsibleFilterError(f"appliance_instances[{n}] must be a mapping, not {entry!r}")
        unknown = set(entry) - set(KEYS)
        if unknown:
            raise AnsibleFilterError(f"appliance_instances[{n}]: unknown keys {sorted(unknown)} (known: {', '.join(KEYS)})")
        name = entry.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise AnsibleFilterError(f"appliance_instances[{n}].name {name!r}: lower-case letters, digits, - and _, "
                                     "at most 32")
        if any(i["name"] == name for i in out):
            raise AnsibleFilterError(f"appliance_instances: the name {name!r} is used twice")
        try:
            port = int(entry["port"])
        except (KeyError, TypeError, ValueError):
            raise AnsibleFilterError(f"appliance_instances[{n}] ({name}): port must be a number") from None
        if not 1 <= port <= 65535 or port in ports:
            raise AnsibleFilterError(f"appliance_instances[{n}] ({name}): port {port} is out of range or "
                                     f"taken by {ports.get(port)!r}")
        ports[port] = name
        item = {k: entry.get(k, defaults.get(k)) for k in INHERITED}
        if item["task"] is not None and item["task"] not in TASKS:
            raise AnsibleFilterError(f"appliance_instances[{n}] ({name}): task {item['task']!r} is not one of "
                                     f"{', '.join(TASKS)}")
        item.update(name=name, port=port, unit=f"appliance@{name}.service",
                    settings=f"{config_dir}/instances/{name}.yml",
                    dropin=f"/etc/systemd/system/appliance@{name}.service.d/instance.conf",
                    kv_cache_dir=f"{kv_cache_dir}/{name}" if kv_cache_dir else None)
        out.append(item)
    return out


def model_files(instances: list[dict]) -> list[dict]:
    """{model, name, sha256, subdir} of every instance's model files, each (model, file) once
    (subdir: the directory a file like 1_Pooling/config.json needs, else None)."""
    out, seen = [], {}
    for instance in instances:
        files = instance.get("model_files") or []
        if files and not instance.get("model_name"):
            raise AnsibleFilterError(f"appliance instance {instance['name'] or 'appliance'}: model_files need a model_name")
        for f in files:
            if not isinstance(f, dict) or "name" not in f or "sha256" not in f:
                raise AnsibleFilterError(f"appliance instance {instance['name'] or 'appliance'}: every model file "
                                         f"needs name and sha256, not {f!r}")
            key = (instance["model_name"], f["name"])
            if key in seen and seen[key] != f["sha256"]:
                raise AnsibleFilterError(f"{key[0]}/{key[1]}: two instances expect different checksums")
            if key not in seen:
                seen[key] = f["sha256"]
                subdir = f"{key[0]}/{key[1].rsplit('/', 1)[0]}" if "/" in key[1] else None
                out.append({"model": key[0], "name": key[1], "sha256": f["sha256"], "subdir": subdir})
    return out


def parse_cpu_list(text) -> set[int]:
    """CPUs of a list as systemd's CPUAffinity= and taskset write them: "4-7", "0,2-3", "7"."""
    cpus: set[int] = set()
    for part in str(text).replace(" ", ",").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        try:
            lo, hi = int(first), int(last or first)
        except ValueError:
            raise AnsibleFilterError(f"CPU list {text!r}: {part!r} is not a CPU or a range like 4-7") from None
        if lo < 0 or hi < lo:
            raise AnsibleFilterError(f"CPU list {text!r}: {part!r} is not a range of CPUs")
        cpus.update(range(lo, hi + 1))
    return cpus


def format_cpu_list(cpus) -> str:
    """The shortest list of ranges: {0, 1, 2, 3, 6} -> "0-3,6"."""
    ranges: list[list[int]] = []                 # [first, last] of each run of consecutive CPUs
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{first}-{last}" if last > first else str(first) for first, last in ranges)


def cpus_left(instances: list[dict], cpu_count) -> str:
    """The board's CPUs that no instance is pinned to ("" when the instances take them all):
    where a rollout's build can run without touching a serving core (on an RK3588, the A55)."""
    taken: set[int] = set()
    for instance in instances:
        if instance.get("cpu_affinity") not in (None, ""):
            taken |= parse_cpu_list(instance["cpu_affinity"])
    return format_cpu_list(set(range(int(cpu_count))) - taken)


class FilterModule:
    def filters(self):
        return {"appliance_instance_list": instance_list, "appliance_model_files": model_files,
                "appliance_cpus_left": cpus_left}
