"""The `speculative` request field through the real server: same answer, usage reports the drafts,
metrics count them, bad values are 400s naming the field; the server default from its setting."""
from __future__ import annotations

import json
import types

import pytest

from appliance.config import load_settings
from appliance.engine.speculative import SpeculativeConfig
from appliance.server import speculative_params
from appliance.server.errors import APIError

# The tiny model's greedy answer loops: prompt lookup finds its n-grams in the answer itself.
PROMPT = "Hello world! How are you today? I am fine, thank you. Hello world! How are you"
SPEC = {"method": "prompt_lookup", "num_tokens": 4, "ngram_min": 1, "ngram_max": 3}


@pytest.mark.parametrize("value,param", [
    ("fast", "speculative"), (4, "speculative"), ([1], "speculative"),
    ({"method": "eagle"}, "speculative.method"), ({"method": 3}, "speculative.method"),
    ({"num_tokens": 0}, "speculative.num_tokens"), ({"num_tokens": 17}, "speculative.num_tokens"),
    ({"num_tokens": "4"}, "speculative.num_tokens"), ({"num_tokens": True}, "speculative.num_tokens"),
    ({"num_tokens": 2.5}, "speculative.num_tokens"), ({"ngram_min": 0}, "speculative.ngram_min"),
    ({"ngram_max": 99}, "speculative.ngram_max"), ({"ngram_min": 5}, "speculative.ngram_min"),
    ({"ngram_min": 2, "ngram_max": 1}, "speculative.ngram_min"), ({"ngram_max": 1}, "speculative.ngram_max"),
    ({"draft_model": "x"}, "speculative.draft_model"),
])
def test_bad_values_name_the_field(value, param):
    with pytest.raises(APIError) as info:
        speculative_params.parse({"speculative": value})
    assert info.value.param == param and info.value.status == 400


def test_fields_fall_back_to_the_server_default_then_the_engine():
    serving = types.SimpleNamespace(speculative=SpeculativeConfig(num_tokens=6))
    assert speculative_params.parse({}, serving) == SpeculativeConfig(num_tokens=6)
    assert speculative_params.parse({"speculative": None}, serving) == SpeculativeConfig(num_tokens=6)
    assert speculative_params.parse({"speculative": False}, serving) is None
    assert speculative_params.parse({"speculative": {"ngram_max": 5}}, serving) == \
        SpeculativeConfig(num_tokens=6, ngram_max=5)
    assert speculative_params.parse({"speculative": {}}) == SpeculativeConfig()
    assert speculative_params.parse({"speculative": {"num_tokens": 3.0}}).num_tokens == 3
    assert speculative_params.parse({}) is None


def test_the_setting_is_the_server_default():
    assert speculative_params.server_default(load_settings(environ={})) is None
    s = load_settings(environ={"APPLIANCE_SPEC_PROMPT_LOOKUP": "5"})
    assert speculative_params.server_default(s) == SpeculativeConfig(num_tokens=5)
    with pytest.raises(ValueError, match="spec_prompt_lookup"):
        load_settings(environ={}, overrides={"spec_prompt_lookup": 17})


def test_errors_over_http(idle_server):
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        r = idle_server.post(path, data=json.dumps({**body, "speculative": {"num_tokens": -1}}),
                             headers={"Content-Type": "application/json"})
        assert r.status_code == 400
        assert r.json()["error"]["param"] == "speculative.num_tokens"
    assert idle_server.health()["status"] == "ready"


def spec_totals(server) -> tuple[float, float]:
    m = server.metrics()
    return m.get(("appliance_spec_draft_tokens_total", ()), 0.0), m.get(("appliance_spec_accepted_tokens_total", ()), 0.0)


def test_same_answer_and_usage_reports_the_drafts(idle_server, openai_client, model_id):
    before = spec_totals(idle_server)
    plain = openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0)
    fast = openai_client.completions.create(model=model_id, prompt=PROMPT, max_tokens=40, temperature=0,
                                            extra_body={"speculative": SPEC})
    assert fast.choices[0].text == plain.choices[0].text
    assert plain.usage.completion_tokens_details is None
    details = fast.usage.completion_tokens_details
    drafted = details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert drafted > 0 and details.accepted_prediction_tokens > 0
    after = spec_totals(idle_server)
    assert after[0] - before[0] == drafted and after[1] - before[1] == details.accepted_prediction_tokens
    m = idle_server.metrics()
    assert m[("appliance_spec_draft_tokens_by_position_total", (("position", "1"),))] > 0


def test_streaming_chat_with_speculation(idle_server, openai_client, model_id):
    messages = [{"role": "user", "content": PROMPT}]
    plain = openai_client.chat.completions.create(model=model_id, messages=messages, max_tokens=30, temperature=0)
    stream = openai_client.chat.completions.create(model=model_id, messages=messages, max_tokens=30, temperature=0,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"speculative": SPEC})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.completion_tokens_details is not None


@pytest.mark.slow
def test_the_dashboard_shows_the_acceptance_rate(idle_server, model_id):
    """In Debian's Chromium: after a speculating request the page shows the share of drafts accepted."""
    import shutil
    playwright = pytest.importorskip("playwright.sync_api")
    chromium = "/usr/bin/chromium"
    if not shutil.which(chromium):
        pytest.skip("chromium: run scripts/ci/install_server_deps.sh")
    args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=args, headless=True)
        try:
            page = browser.new_page()
            page.goto(idle_server.base + "/", wait_until="load")
            page.wait_for_timeout(500)                  # the page's first read of /metrics
            for _ in range(2):
                r = idle_server.post("/v1/completions", json={"model": model_id, "prompt": PROMPT, "max_tokens": 40,
                                                              "temperature": 0, "speculative": SPEC})
                assert r.status_code == 200
            drafted, _ = spec_totals(idle_server)
            want = f"% of {int(drafted)} overall)"          # the total the page read last: both requests
            page.wait_for_function("(want) => { const el = document.getElementById('spec-now');"
                                   " return el !== null && el.textContent.includes(want); }", arg=want, timeout=30000)
            assert page.text_content("#spec-now").startswith("drafts accepted ")
        finally:
            browser.close()
