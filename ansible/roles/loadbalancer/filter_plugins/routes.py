"""Where the load balancer sends a request, from the boards' inventory, as a filter.

Each board runs the instances of its appliance_instances (or one, from its single-instance
variables): a task (chat, embed, rerank), a port and the model names it answers to
(served_model_name, else model_name). The balancer gets
  - one upstream per task holding every instance of that task on every board
    (appliance_boards for chat, appliance_embed, appliance_rerank): a request goes there by
    its path (/v1/embeddings, /v1/rerank; chat for everything else);
  - one upstream per model name whose instances differ from their task's upstream: a
    request naming that `model` goes there, whatever its path.
"""
from __future__ import annotations

import re

from ansible.errors import AnsibleFilterError

TASK_UPSTREAMS = {"chat": "appliance_boards", "embed": "appliance_embed", "rerank": "appliance_rerank"}


def _names(value) -> list[str]:
    if not value:
        return []
    return [n.strip() for n in str(value).split(",") if n.strip()]


def board_instances(board: str, hv, backend_port: int) -> list[dict]:
    """[{instance, task, port, names}] a board runs, read from its inventory variables."""
    entries = hv.get("appliance_instances") or []
    default_task = hv.get("appliance_task") or "chat"
    if not entries:
        return [{"instance": "", "task": default_task, "port": int(backend_port),
                 "names": _names(hv.get("appliance_served_model_name") or hv.get("appliance_model_name"))}]
    out = []
    for entry in entries:
        if not isinstance(entry, dict) or "name" not in entry or "port" not in entry:
            raise AnsibleFilterError(f"{board}: every appliance_instances entry needs a name and a port, not {entry!r}")
        task = entry.get("task") or default_task
        if task not in TASK_UPSTREAMS:
            raise AnsibleFilterError(f"{board}: instance {entry['name']}: task {task!r} is not one of "
                                     f"{', '.join(TASK_UPSTREAMS)}")
        names = _names(entry.get("served_model_name") or entry.get("model_name") or hv.get("appliance_model_name"))
        out.append({"instance": entry["name"], "task": task, "port": int(entry["port"]), "names": names})
    return out


def routes(boards, hostvars, backend_port) -> dict:
    """{upstreams: {name: [{board, address, port, instance}]}, tasks: {task: upstream},
    models: {model name: upstream}}, every list sorted so the configuration is stable."""
    upstreams: dict[str, list] = {}
    by_name: dict[str, list] = {}
    for board in sorted(boards):
        hv = hostvars[board]
        address = hv.get("fleet_address") or hv.get("ansible_host") or board
        for inst in board_instances(board, hv, backend_port):
            server = {"board": board, "address": address, "port": inst["port"], "instance": inst["instance"]}
            upstreams.setdefault(TASK_UPSTREAMS[inst["task"]], []).append(server)
            for name in inst["names"]:
                by_name.setdefault(name, []).append((inst["task"], server))
    upstreams.setdefault("appliance_boards", [])
    tasks = {task: up for task, up in TASK_UPSTREAMS.items() if up in upstreams}
    models, taken = {}, {}
    for name, served in sorted(by_name.items()):
        task_list = {t for t, _ in served}
        servers = [s for _, s in served]
        if len(task_list) == 1 and servers == upstreams[TASK_UPSTREAMS[next(iter(task_list))]]:
            models[name] = TASK_UPSTREAMS[next(iter(task_list))]          # its task's upstream already
            continue
        key = tuple((s["board"], s["port"]) for s in servers)
        if key in taken:                                                  # an alias of a model seen before
            models[name] = taken[key]
            continue
        upstream = "appliance_model_" + re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
        while upstream in upstreams:
            upstream += "_"
        upstreams[upstream] = servers
        taken[key] = models[name] = upstream
    return {"upstreams": dict(sorted(upstreams.items())), "tasks": tasks, "models": models,
            "by_model": len(upstreams) > 1}


class FilterModule:
    def filters(self):
        return {"loadbalancer_routes": routes}
