"""Routing through the load balancer on the simulated fleet (tests/fleet/fleetlab.py, after
test_lab.py): a conversation's requests come back to one board, where its prefix cache is,
and move to another board while that one is drained - the other conversations stay put."""
from __future__ import annotations

import json
import re

import pytest

from fleetlab import API_KEY, BOARDS, LB, need

pytestmark = [pytest.mark.fleet, pytest.mark.slow]
SESSIONS = [f"conversation-{n}" for n in range(8)]
# Longer than a few KV blocks, so a second turn finds whole blocks of it cached.
HISTORY = " ".join(f"Turn {n}: the operator asked about board temperatures and the fan." for n in range(12))


def post(lab, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    argv = ["curl", "-s", "-m", "60", "-w", "\n%{http_code}", "-H", "Content-Type: application/json",
            "-H", f"Authorization: Bearer {API_KEY}"]
    for k, v in (headers or {}).items():
        argv += ["-H", f"{k}: {v}"]
    proc = lab.ns(argv + ["--data-binary", json.dumps(body), LB + path], timeout=90)
    text, _, code = proc.stdout.rpartition("\n")
    return int(code or 0), (json.loads(text) if text.startswith("{") else {"raw": text})


def finished(lab) -> dict[str, float]:
    """Requests each board has finished so far, by its own counter."""
    out = {}
    for board in BOARDS:
        code, metrics = lab.get(f"{LB}/boards/{board}/metrics")
        assert code == 200, f"{board}: /metrics {code}"
        out[board] = sum(float(v) for v in re.findall(r"^appliance_requests_total\{[^}]*\} (\S+)$", metrics, re.M))
    return out


def turn(lab, session: str, n: int) -> dict:
    code, body = post(lab, "/v1/chat/completions",
                      {"messages": [{"role": "system", "content": HISTORY},
                                    {"role": "user", "content": f"Question {n} of {session}"}],
                       "max_tokens": 4, "temperature": 0}, {"X-Session-Id": session})
    assert code == 200, f"{session}: HTTP {code} {body}"
    return body


def board_of(lab, session: str, turns: int = 2) -> tuple[str, list[dict]]:
    """The one board that served `turns` requests of the session (fails if they spread)."""
    before = finished(lab)
    answers = [turn(lab, session, n) for n in range(turns)]
    after = finished(lab)
    served = {b: after[b] - before[b] for b in BOARDS if after[b] != before[b]}
    assert len(served) == 1 and list(served.values()) == [turns], f"{session}'s requests went to {served}"
    return next(iter(served)), answers


def drain_by_the_operator(lab, boards: list[str]) -> None:
    rc, out = lab.playbook("site.yml", "--limit", "loadbalancer", "-e", json.dumps({"loadbalancer_drained": boards}))
    assert rc == 0, out[-6000:]


def test_a_session_comes_back_to_its_board_and_moves_while_that_board_is_drained(lab):
    need("site")
    home = {}
    for session in SESSIONS:
        home[session], answers = board_of(lab, session)
        cached = answers[-1]["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        assert cached > 0, f"{session}: its second turn on {home[session]} found nothing cached: {answers[-1]['usage']}"
    assert len(set(home.values())) >= 2, f"every session hashed to one board: {home}"
    moved = SESSIONS[0]
    drained = home[moved]
    drain_by_the_operator(lab, [drained])
    try:
        elsewhere, _ = board_of(lab, moved)
        assert elsewhere != drained
        for session in SESSIONS:
            if home[session] != drained:
                assert board_of(lab, session, turns=1)[0] == home[session], \
                    f"{session} left {home[session]}, which stayed in rotation"
    finally:
        drain_by_the_operator(lab, [])
    assert board_of(lab, moved, turns=1)[0] == drained, f"{moved} did not come back to {drained}"

