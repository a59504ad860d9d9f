"""The dashboard as a newcomer meets it, in Debian's Chromium at a phone's width (390 px) and a
desktop's (1366 px), with full-page screenshots kept (the test's tmp dir, and artifacts/):

- the embedded demo model on a machine without sensors: the demo note, no thermal section
  (a line says why), human labels with units, settings only where they mean something, the
  chat log following its newest line;
- a checkpoint without a chat template, speculating by default: plain completions through
  /v1/completions, a chat attempt failing with its message and no empty reply, the
  speculative-decoding charts (over time and by position in the draft), /health saying
  speculation is on.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from live_server import serving  # noqa: E402
from browser_kit import ARGS, CHROMIUM, INKED  # noqa: E402

WIDTHS = {"phone": {"width": 390, "height": 844}, "desktop": {"width": 1366, "height": 900}}
# The tiny model's greedy answer loops: prompt lookup finds its n-grams in the answer itself.
COPY_PROMPT = "Hello world! How are you today? I am fine, thank you. Hello world! How are you"

needs_chromium = pytest.mark.skipif(not shutil.which(CHROMIUM), reason="chromium: run scripts/ci/install_server_deps.sh")

# Anything wider than the viewport, and the page's own scroll width (what a phone scrolls sideways).
LAYOUT = """() => {
  const vw = document.documentElement.clientWidth;
  const wide = [...document.querySelectorAll('body *')].filter(el => {
    const r = el.getBoundingClientRect();
    return r.width > 0 && (r.right > vw + 1 || r.left < -1) && !el.closest('#chat-log');
  }).map(el => el.id || `${el.tagName.toLowerCase()}.${el.className}`);
  return {scroll: document.documentElement.scrollWidth, viewport: vw, wide: wide.slice(0, 8)};
}"""
KEY_ELEMENTS = ("#status", "#model-name", "#chart-decode", "#chart-tps", "#chat-log", "#chat-input",
                "#chat-send", "#chat-max", "#model-facts", "#settings-facts")


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    """The demo model (no --model) on a machine whose sysfs has no thermal zones or cpufreq."""
    bare = tmp_path_factory.mktemp("bare-sysfs")
    with serving(None, "--request-timeout", "60", env={"APPLIANCE_SYSFS_ROOT": str(bare)}) as srv:
        yield srv


@pytest.fixture(scope="module")
def plain_server(tiny_qwen3_dir, tmp_path_factory):
    """The tiny checkpoint without its chat template, speculating unless a request says otherwise."""
    model = tmp_path_factory.mktemp("no-template") / "qwen3-plain"
    shutil.copytree(tiny_qwen3_dir, model, ignore=shutil.ignore_patterns(".appliance-cache"))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    (model / "chat_template.jinja").unlink(missing_ok=True)
    with serving(model, "--spec-prompt-lookup", "4", "--request-timeout", "60") as srv:
        yield srv


def open_page(browser, base: str, viewport: dict, requests_seen: list | None = None, console: list | None = None):
    page = browser.new_page(viewport=viewport)
    if requests_seen is not None:
        page.on("request", lambda r: requests_seen.append(r.url))
    if console is not None:
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    assert page.goto(base + "/", wait_until="load").status == 200
    page.wait_for_function("() => document.getElementById('model-name').textContent !== '' && "
                           "Number(document.body.dataset.drawn) >= 2", timeout=30000)
    return page


def check_layout(page, name: str) -> None:
    layout = page.evaluate(LAYOUT)
    assert layout["scroll"] <= layout["viewport"] and not layout["wide"], (name, layout)
    for sel in KEY_ELEMENTS:
        box = page.locator(sel).bounding_box()
        assert page.locator(sel).is_visible() and box and box["width"] > 0, (name, sel)
        assert box["x"] >= 0 and box["x"] + box["width"] <= layout["viewport"] + 1, (name, sel, box)


def keep_screenshot(page, tmp_path: Path, artifacts_dir: Path, name: str) -> Path:
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    shutil.copy(path, artifacts_dir / path.name)
    assert path.stat().st_size > 10_000
    return path


def rows(page, table: str) -> dict[str, str]:
    return dict(page.evaluate(f"""() => [...document.querySelectorAll('#{table} tr')].map(tr =>
        [tr.cells[0].textContent, tr.cells[1].textContent])"""))


@pytest.mark.slow
@needs_chromium
@pytest.mark.parametrize("width", list(WIDTHS))
def test_demo_model_on_a_board_without_sensors(demo_server, width, tmp_path, artifacts_dir):
    playwright = pytest.importorskip("playwright.sync_api")
    console: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = open_page(browser, demo_server.base, WIDTHS[width], console=console)
            page.wait_for_function("() => !document.getElementById('thermal-none').hidden", timeout=15000)
            # the demo model says what it is
            note = page.locator("#demo-note")
            assert note.is_visible() and "4 million parameters" in note.text_content()
            # no sensors: no thermal charts, table or badge, and a line that says so
            for sel in ("#card-temp", "#card-freq", "#thermal-section", "#throttle"):
                assert not page.locator(sel).is_visible(), sel
            assert "No thermal zones" in page.text_content("#thermal-none")
            # speculation is off and nothing was drafted: no charts for it
            assert not page.locator("#card-spec").is_visible()

            facts, settings = rows(page, "model-facts"), rows(page, "settings-facts")
            assert not [k for k in list(facts) + list(settings) if "_" in k], (facts, settings)
            assert facts["Family"] == "Qwen3" and facts["Weights"].startswith("Q8_0")
            assert facts["Weights in memory"].endswith(" MiB") and facts["KV pool memory"].endswith(" MiB")
            assert facts["KV bytes per token per layer"].endswith(" B")
            assert facts["Context limit"].endswith(" tokens") and facts["Attention"] == "exact"
            assert "{" not in facts["Sampling defaults"]                 # read out, not a JSON blob
            assert "Sparse attention" not in settings and "Prefix cache disk budget" not in settings
            assert settings["Largest request body"] == "16 MiB" and settings["Request time limit"] == "60 s"
            assert settings["Speculative decoding"].startswith("off")
            assert not [v for v in list(facts.values()) + list(settings.values()) if v in ("", "—", "None")]
            check_layout(page, width)
            keep_screenshot(page, tmp_path, artifacts_dir, f"dashboard-demo-{width}")

            # the log follows the newest line: older lines fill it, then a streamed reply arrives
            for i in range(25):
                page.evaluate("(t) => window.applianceAddMessage('assistant', t)", f"earlier line {i}")
            page.fill("#chat-input", "What does json.dumps do?")
            page.fill("#chat-max", "48")
            page.click("#chat-send")
            page.wait_for_function("() => ['done', 'error'].includes(document.body.dataset.chat)", timeout=60000)
            assert page.evaluate("() => document.body.dataset.chat") == "done", page.text_content("#chat-log")
            page.wait_for_timeout(100)
            log = page.evaluate("""() => { const l = document.getElementById('chat-log');
                return {top: l.scrollTop, height: l.clientHeight, scroll: l.scrollHeight}; }""")
            assert log["scroll"] > log["height"], log                           # it overflows...
            assert log["top"] + log["height"] >= log["scroll"] - 2, log          # ...and shows its end
            assert "tokens/s" in page.text_content("#chat-stats")
            check_layout(page, width)
            keep_screenshot(page, tmp_path, artifacts_dir, f"dashboard-demo-chat-{width}")
        finally:
            browser.close()
    assert not [c for c in console if c.startswith("error")], console


@pytest.mark.slow
@needs_chromium
@pytest.mark.parametrize("width", list(WIDTHS))
def test_plain_completions_and_speculation_charts(plain_server, width, tmp_path, artifacts_dir):
    playwright = pytest.importorskip("playwright.sync_api")
    model_id = plain_server.get("/v1/models").json()["data"][0]["id"]
    requests_seen: list[str] = []
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS, headless=True)
        try:
            page = open_page(browser, plain_server.base, WIDTHS[width], requests_seen=requests_seen)
            # no chat template: completion mode, chat disabled, the reason shown, chat-only controls gone
            assert page.eval_on_selector("#chat-mode", "s => s.value") == "completion"
            assert page.eval_on_selector("#chat-mode option[value=chat]", "o => o.disabled")
            assert page.locator("#mode-note").is_visible()
            assert not page.locator("#chat-think").is_visible() and not page.locator("#chat-tools").is_visible()
            assert not page.locator("#demo-note").is_visible()
            assert page.locator("#card-temp").is_visible() and page.locator("#thermal-section").is_visible()
            # speculating by default: its chart is there before any draft, and says it is on
            assert page.locator("#card-spec").is_visible()
            if plain_server.health()["speculative"]["draft_tokens"] == 0:       # the first page this server shows
                assert page.text_content("#spec-now").startswith("on, up to 4 tokens")
            assert rows(page, "settings-facts")["Speculative decoding"].startswith("prompt lookup, up to 4")

            page.fill("#chat-input", COPY_PROMPT)
            page.fill("#chat-max", "40")
            page.click("#chat-send")
            page.wait_for_function("() => ['done', 'error'].includes(document.body.dataset.chat)", timeout=60000)
            assert page.evaluate("() => document.body.dataset.chat") == "done", page.text_content("#chat-log")
            reply = page.locator("#chat-log .msg.assistant .text").all_text_contents()
            assert len(reply) == 1 and reply[0]
            assert any(u.endswith("/v1/completions") for u in requests_seen)
            assert not any(u.endswith("/v1/chat/completions") for u in requests_seen)

            # drafts verified: the acceptance charts fill, over time and by position in the draft
            page.wait_for_function("() => !document.getElementById('card-spec-position').hidden && "
                                   "document.getElementById('spec-now').textContent.startsWith('drafts accepted')",
                                   timeout=15000)
            # polled: a second's drafts reach the chart once that second is over
            spec_charts = ["chart-spec", "chart-spec-position"]
            drawn_points = "(ids) => ids.map(id => Number(document.getElementById(id).dataset.points))"
            inked, drawn = [], []
            for _ in range(40):
                inked, drawn = page.evaluate(INKED, spec_charts), page.evaluate(drawn_points, spec_charts)
                if all(n > 200 for n in inked) and all(n >= 1 for n in drawn):
                    break
                page.wait_for_timeout(250)
            assert all(n > 200 for n in inked) and all(n >= 1 for n in drawn), (inked, drawn)  # data, not only axes
            health = plain_server.health()["speculative"]
            assert health["default"]["num_tokens"] == 4 and health["default"]["method"] == "prompt_lookup"
            assert health["draft_tokens"] > 0 and health["by_position"][0]["position"] == 1
            check_layout(page, width)
            keep_screenshot(page, tmp_path, artifacts_dir, f"dashboard-plain-{width}")

            # a chat forced on a checkpoint without a template: its 400 shown, no empty reply left above it
            page.evaluate("""() => { const s = document.getElementById('chat-mode');
                s.querySelector('option[value=chat]').disabled = false; s.value = 'chat';
                s.dispatchEvent(new Event('change')); }""")
            page.fill("#chat-input", "Hello")
            page.click("#chat-send")
            page.wait_for_function("() => ['done', 'error'].includes(document.body.dataset.chat) && "
                                   "document.querySelectorAll('#chat-log .msg').length >= 4", timeout=30000)
            assert page.evaluate("() => document.body.dataset.chat") == "error"
            assert "400" in page.locator("#chat-log .msg.error .text").last.text_content()
            assert page.locator("#chat-log .msg.assistant").count() == 1
        finally:
            browser.close()
    assert model_id


def test_health_says_whether_speculation_is_on(plain_server, idle_server):
    assert idle_server.health()["speculative"]["default"] is None
    spec = plain_server.health()["speculative"]
    assert spec["default"] == {"method": "prompt_lookup", "num_tokens": 4, "ngram_min": 2, "ngram_max": 4,
                               "adaptive": True}
    assert {"draft_tokens", "accepted_tokens", "by_position"} <= set(spec)
