"""The drain state each load balancer keeps (loadbalancer_state_file), as a filter.

State of one balancer: {board: {"since": <unix seconds>, "by": "rollout" | "operator"}}.
A rollout drains and undrains only its own entries; boards the operator lists in
loadbalancer_drained stay out of rotation whatever a rollout does, and come back when
the operator takes them off the list.
"""
from __future__ import annotations

import base64
import json
import time

from ansible.errors import AnsibleFilterError


def _boards(value, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str) or not all(isinstance(v, str) for v in value):
        raise AnsibleFilterError(f"loadbalancer: {what} must be a list of board names, not {value!r}")
    return list(value)


def parse_state(read: dict) -> dict | None:
    """The state from a slurp result; None when the file does not exist yet."""
    if not read or read.get("failed") or "content" not in read:
        message = (read or {}).get("msg", "")
        if message and "not found" not in message.lower() and "no such file" not in message.lower():
            raise AnsibleFilterError(f"loadbalancer: cannot read the drain state: {message}")
        return None
    try:
        state = json.loads(base64.b64decode(read["content"]) or b"{}")
    except ValueError as e:
        raise AnsibleFilterError(f"loadbalancer: the drain state is not JSON ({e})") from e
    if not isinstance(state, dict) or not all(isinstance(v, dict) and "by" in v for v in state.values()):
        raise AnsibleFilterError(f"loadbalancer: unexpected drain state {state!r}")
    return state


def next_state(state: dict, drain=(), undrain=(), pinned=(), now: float | None = None) -> dict:
    drain, undrain, pinned = (_boards(drain, "loadbalancer_drain"), _boards(undrain, "loadbalancer_undrain"),
                              _boards(pinned, "loadbalancer_drained"))
    since = int(time.time() if now is None else now)
    new = {}
    for board, entry in state.items():
        if entry["by"] == "operator" and board not in pinned:
            continue                                  # the operator put it back
        if entry["by"] == "rollout" and board in undrain:
            continue                                  # the rollout that drained it is done with it
        new[board] = dict(entry)
    for board in drain:
        new.setdefault(board, {"since": since, "by": "rollout"})
    for board in pinned:
        new.setdefault(board, {"since": since, "by": "operator"})["by"] = "operator"
    return dict(sorted(new.items()))


def drain_states(reads: list, pinned_by_balancer: dict, drain=(), undrain=(), now: float | None = None) -> dict:
    """{balancer: new state} from the slurp results of every balancer (loop_var loadbalancer_target)."""
    out = {}
    for read in reads:
        balancer = read["loadbalancer_target"]
        out[balancer] = next_state(parse_state(read) or {}, drain, undrain, pinned_by_balancer.get(balancer, []), now)
    return out


def read_states(reads: list) -> dict:
    """{balancer: state as it is on the balancer, None where it has none yet}."""
    return {read["loadbalancer_target"]: parse_state(read) for read in reads}


class FilterModule:
    def filters(self):
        return {"loadbalancer_drain_states": drain_states, "loadbalancer_read_states": read_states}
