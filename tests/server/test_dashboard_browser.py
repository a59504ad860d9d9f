"""The dashboard in Debian's Chromium through pip's Playwright (never `playwright install`)."""
from __future__ import annotations

import re
import shutil
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from browser_kit import ARGS, CHROMIUM, INKED  # noqa: E402

# Charts every server with sensors shows (speculative decoding's appear once drafts are verified;
# the CPU's where the kernel counts run-queue waits, as Debian's and Rockchip's kernels do).
BASE_CHARTS = ["chart-decode", "chart-attn", "chart-tps", "chart-queue", "chart-temp", "chart-freq"]
SCHEDSTAT = Path("/proc/self/schedstat").exists()
CHARTS = BASE_CHARTS + (["chart-cpu"] if SCHEDSTAT else [])

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not shutil.which(CHROMIUM), reason="chromium: run scripts/ci/install_server_deps.sh"),
]


def test_dashboard_page_served(idle_server):
    r = idle_server.get("/")
    assert r.status_code == 200 and "text/html" in r.headers["Content-Type"]
    csp = r.headers["Content-Security-Policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp
    assert "http://" not in r.text.replace(idle_server.base, "") and "https://" not in r.text
    for asset in ("/static/charts.js", "/static/dashboard.js", "/static/dashboard.css"):
        body = idle_server.get(asset).text
        assert "https://" not in body and "http://" not in body, asset


def test_dashboard_live_charts_and_chat(idle_server, model_id, artifacts_dir):
    playwright = pytest.importorskip("playwright.sync_api")

    # traffic in the background so the decode charts have live points; sent while the page
    # polls, so that its seconds close one by one and their CPU time is their own
    def traffic():
        for i in range(3):
            idle_server.post("/v1/completions", json={"model": model_id, "prompt": f"Edge board {i}",
                                                      "max_tokens": 200, "ignore_eos": True})

    bg = threading.Thread(target=traffic)
    requests_seen, console = [], []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.on("request", lambda r: requests_seen.append(r.url))
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
            resp = page.goto(idle_server.base + "/", wait_until="load")
            assert resp.status == 200
            page.wait_for_function("() => Number(document.body.dataset.drawn) >= 1", timeout=30000)
            bg.start()
            bg.join(60)
            # charts drawn from live data: decode points, thermal series from the fake tree
            # function form: a string expression would need eval, which the page's CSP forbids
            page.wait_for_function("() => Number(document.body.dataset.drawn) >= 2 && "
                                   "Number(document.body.dataset.points) > 20", timeout=30000)
            # every chart inked (axes, lines, legend); polled: a chart fills at the next poll
            inked, deadline = [], time.monotonic() + 20
            while time.monotonic() < deadline:
                inked = page.evaluate(INKED, CHARTS)
                if len(inked) == len(CHARTS) and all(n > 200 for n in inked):
                    break
                page.wait_for_timeout(250)
            assert len(inked) == len(CHARTS) and all(n > 200 for n in inked), (inked, console)
            if SCHEDSTAT:   # the traffic ran on this machine's cores: the process ran, and says how long it waited
                series = idle_server.get("/dashboard/stats").json()["series"]
                assert max(s["cpu_run_cores"] or 0 for s in series) > 0.05, series[-20:]
                assert all(s["cpu_wait_cores"] >= 0 for s in series if s["cpu_wait_cores"] is not None)
                # the demo model's traffic takes under a second: the last seconds may be idle
                assert re.fullmatch(r"[0-9.]+ cores; waited \d+% as long as it ran \(last \d+ s\)|idle",
                                    page.text_content("#cpu-now")), page.text_content("#cpu-now")
            assert page.text_content("#status") == "ready", console
            assert page.text_content("#model-name") == model_id
            assert "bigcore0-thermal" in page.text_content("#thermal-facts")

            # a chat round trip, streamed into the page
            page.fill("#chat-input", "Hello world! How are you today?")
            page.fill("#chat-max", "24")
            page.click("#chat-send")
            page.wait_for_function("() => ['done', 'error'].includes(document.body.dataset.chat)",
                                   timeout=60000)
            assert page.evaluate("() => document.body.dataset.chat") == "done", page.text_content("#chat-log")
            assert int(page.evaluate("() => document.body.dataset.chatChunks")) >= 1
            replies = page.locator("#chat-log .msg.assistant .text").all_text_contents()
            assert len(replies) == 1 and replies[0]
            assert "tokens in" in page.text_content("#chat-stats")

            # model output is text, never markup
            page.evaluate("(t) => window.applianceAddMessage('assistant', t)",
                          '<img src=x onerror="window.__pwned=1"><b>bold</b>')
            assert page.locator("#chat-log img").count() == 0 and page.locator("#chat-log b").count() == 0
            assert "<img src=x" in page.locator("#chat-log .msg.assistant .text").last.text_content()
            assert page.evaluate("() => window.__pwned === undefined")

            page.wait_for_timeout(1200)         # one more poll with the chat's tokens in the charts
            page.screenshot(path=str(artifacts_dir / "dashboard.png"), full_page=True)
        finally:
            browser.close()
    hosts = {urlparse(u).netloc for u in requests_seen if not u.startswith("data:")}
    assert hosts == {f"127.0.0.1:{idle_server.port}"}, hosts        # nothing leaves localhost
    assert any(u.endswith("/v1/chat/completions") for u in requests_seen)
    assert not [c for c in console if c.startswith("error")], console
    assert (artifacts_dir / "dashboard.png").stat().st_size > 10_000


def _sse(*deltas, finish=None) -> str:
    """A recorded chat stream: one chunk per delta, then the finish and [DONE]."""
    import json as _json

    def chunk(delta, finish_reason=None):
        return "data: " + _json.dumps({"id": "chatcmpl-x", "object": "chat.completion.chunk", "created": 0,
                                       "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                                                  "finish_reason": finish_reason}]}) + "\n\n"
    return "".join(chunk(d) for d in deltas) + chunk({}, finish) + "data: [DONE]\n\n"


def test_dashboard_chat_reasoning_tool_calls_and_thinking_switch(idle_server):
    """The chat panel against recorded streams: the thought folded above the answer, a tool call
    shown as such, run by the page on the board's own sensors and sent back as a tool message,
    and the thinking switch reaching the template as enable_thinking."""
    import json as _json

    playwright = pytest.importorskip("playwright.sync_api")
    first = _sse({"role": "assistant", "content": ""}, {"reasoning_content": "The user asks about the "},
                 {"reasoning_content": "big cores."}, {"content": "Let me read it."},
                 {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                  "function": {"name": "read_board_sensor", "arguments": ""}}]},
                 # the zone named as a model may name it
                 {"tool_calls": [{"index": 0, "function": {"arguments": '{"sensor": "Bigcore0 sensor"}'}}]},
                 finish="tool_calls")
    second = _sse({"role": "assistant", "content": ""}, {"content": "The big cores are warm."}, finish="stop")
    bodies = []

    def answer(route):
        bodies.append(_json.loads(route.request.post_data))
        route.fulfill(status=200, headers={"Content-Type": "text/event-stream"},
                      body=first if len(bodies) == 1 else second)

    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.route("**/v1/chat/completions", answer)
            page.goto(idle_server.base + "/", wait_until="load")
            page.wait_for_function("() => document.querySelector('#thermal-facts').textContent.includes('bigcore0')",
                                   timeout=30000)
            page.check("#chat-tools")
            page.fill("#chat-input", "How warm are the big cores?")
            page.click("#chat-send")
            page.wait_for_function("() => ['done', 'error'].includes(document.body.dataset.chat)", timeout=30000)
            assert page.evaluate("() => document.body.dataset.chat") == "done", page.text_content("#chat-log")
            assert page.evaluate("() => document.body.dataset.chatToolCalls") == "1"
            fold = page.locator("#chat-log .msg.assistant details.reasoning").first
            assert fold.text_content().endswith("The user asks about the big cores.")
            assert not fold.evaluate("d => d.open")                   # folded once the answer came
            assert "read_board_sensor" in page.locator("#chat-log .call").first.text_content()
            tool_line = page.locator("#chat-log .msg.tool .text").first.text_content()
            assert "bigcore0-thermal" in tool_line and "celsius" in tool_line
            replies = page.locator("#chat-log .msg.assistant .text").all_text_contents()
            assert replies == ["Let me read it.", "The big cores are warm."]
            assert bodies[0]["tools"][0]["function"]["name"] == "read_board_sensor"
            assert bodies[0]["chat_template_kwargs"] == {"enable_thinking": True}
            history = bodies[1]["messages"]
            assert [m["role"] for m in history] == ["user", "assistant", "tool"]
            assert history[1]["tool_calls"][0]["function"]["arguments"] == '{"sensor": "Bigcore0 sensor"}'
            assert history[1]["reasoning_content"] == "The user asks about the big cores."
            result = _json.loads(history[2]["content"])
            assert history[2]["tool_call_id"] == "call_1" and result["sensor"] == "bigcore0-thermal"
            # the zone's reading as the page had it (JSON drops the ".0" of a whole degree)
            assert isinstance(result["celsius"], (int, float)) and 20 <= result["celsius"] <= 120

            page.uncheck("#chat-think")
            page.uncheck("#chat-tools")
            page.fill("#chat-input", "Thanks")
            page.click("#chat-send")
            page.wait_for_function("() => document.body.dataset.chat === 'done' && "
                                   "document.querySelectorAll('#chat-log .msg.assistant').length === 3",
                                   timeout=30000)
            assert bodies[2]["chat_template_kwargs"] == {"enable_thinking": False} and "tools" not in bodies[2]
        finally:
            browser.close()
