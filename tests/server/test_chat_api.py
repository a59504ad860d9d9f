"""Qwen3 conversations through the server on a tiny random checkpoint with Qwen3's template:
the conversations clients send (200, and counted as transformers counts them), thinking
control, the thinking budget, served model names, /tokenize with tools, sampling fields."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from chat_conversations import CONVERSATIONS, TOOLS  # noqa: E402
from live_server import start_server  # noqa: E402

LONG = {"ignore_eos": True}


@pytest.fixture(scope="module")
def hf_tokenizer(qwen3_chat_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(qwen3_chat_dir)


def hf_count(hf_tokenizer, messages, tools=None, **kwargs) -> int:
    text = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs)
    return len(hf_tokenizer(text, add_special_tokens=False)["input_ids"])


@pytest.mark.parametrize("name, messages, tools, kwargs", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_conversation_through_the_server(chat_server, chat_client, hf_tokenizer, name, messages, tools, kwargs):
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    r = chat_client.chat.completions.create(model="qwen3-tiny", messages=messages, tools=tools, max_tokens=4,
                                            temperature=0, extra_body=extra)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens == hf_count(hf_tokenizer, messages, tools, **kwargs)
    counted = chat_server.post("/tokenize", json={"messages": messages, "tools": tools, **extra}).json()
    assert counted["count"] == r.usage.prompt_tokens


def test_assistant_content_null_beside_tool_calls(chat_server, hf_tokenizer):
    _, messages, tools, _ = CONVERSATIONS[7]
    nulled = [dict(m, content=None) if m.get("tool_calls") else m for m in messages]
    r = chat_server.post("/v1/chat/completions", json={"messages": nulled, "tools": tools, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == hf_count(hf_tokenizer, messages, tools)


def test_tool_choice_none_hides_the_tools(chat_server, hf_tokenizer):
    messages = CONVERSATIONS[5][1]
    shown = chat_server.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 1})
    hidden = chat_server.post("/v1/chat/completions", json={"messages": messages, "tools": TOOLS, "max_tokens": 1,
                                                           "tool_choice": "none"})
    assert shown.json()["usage"]["prompt_tokens"] == hf_count(hf_tokenizer, messages, TOOLS)
    assert hidden.json()["usage"]["prompt_tokens"] == hf_count(hf_tokenizer, messages)
    assert "tool_calls" not in hidden.json()["choices"][0]["message"]


def test_served_model_names(chat_server, chat_client):
    assert [m.id for m in chat_client.models.list().data] == ["qwen3-tiny", "gpt-4o-mini"]
    r = chat_client.chat.completions.create(model="gpt-4o-mini", messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=2)
    assert r.model == "gpt-4o-mini"
    assert chat_client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"
    assert chat_server.post("/v1/chat/completions", json={"model": "tiny_qwen3", "messages": [
        {"role": "user", "content": "Hi"}]}).status_code == 404


def test_thinking_budget_closes_the_thought_and_reasoning_is_split(chat_server, qwen3_chat_dir):
    """A random model that is made to open a thought (and to keep writing the tag) thinks
    exactly the budget, then the server closes the thought; the reply's thought is in
    reasoning_content, streaming or not."""
    tok = json.loads((qwen3_chat_dir / "tokenizer.json").read_text())
    think = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<think>")
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 12, "temperature": 0,
            "logit_bias": {str(think): 100}, "max_thinking_tokens": 3, **LONG}
    r = chat_server.post("/v1/chat/completions", json=body).json()
    msg = r["choices"][0]["message"]
    assert msg["reasoning_content"] == "<think>" * 3
    close = sum(len(chat_server.post("/tokenize", json={"prompt": t}).json()["tokens"]) for t in ("\n", "\n\n"))
    # <think>, 3 thought tokens, the forced newline, </think> and blank line, then the answer
    assert msg["content"] == "<think>" * (12 - 1 - 3 - close - 1)
    assert r["choices"][0]["finish_reason"] == "length"
    chunks = stream_events(chat_server, body)
    assert "".join(c["delta"].get("reasoning_content") or "" for c in chunks) == msg["reasoning_content"]
    assert "".join(c["delta"].get("content") or "" for c in chunks) == msg["content"]
    cut = chat_server.post("/v1/chat/completions", json=dict(body, max_tokens=3)).json()["choices"][0]
    assert cut["message"]["reasoning_content"] == "<think>" * 2 and cut["message"]["content"] == ""
    assert cut["finish_reason"] == "length"


def stream_events(server, body) -> list[dict]:
    r = server.post("/v1/chat/completions", json=dict(body, stream=True), stream=True)
    out = []
    for line in r.iter_lines(decode_unicode=True):
        if line.startswith("data: ") and line != "data: [DONE]":
            out += json.loads(line[6:])["choices"]
    return out


def test_sampling_fields_are_honoured(chat_server):
    base = {"messages": [{"role": "user", "content": "Hello world!"}], "max_tokens": 6, "temperature": 0, **LONG}
    x, y = chat_server.post("/tokenize", json={"prompt": "Hello world"}).json()["tokens"][:2]
    text = lambda r: r["choices"][0]["message"]["content"]

    def ask(**fields):
        r = chat_server.post("/v1/chat/completions", json=dict(base, **fields))
        assert r.status_code == 200, r.text
        return r.json()

    favoured = ask(logit_bias={str(x): 100, str(y): 50})
    assert text(favoured) == "Hello" * 6
    banned = ask(logit_bias={str(x): -100, str(y): 50})
    assert text(banned) == " world" * 6
    # a presence penalty of 2 cannot outweigh +100; a frequency penalty of 2 per use soon does
    assert text(ask(logit_bias={str(x): 100, str(y): 95}, presence_penalty=2.0)) == "Hello" * 6
    assert " world" in text(ask(logit_bias={str(x): 100, str(y): 95}, frequency_penalty=2.0))
    stopped = ask(logit_bias={str(x): 100}, stop_token_ids=[x])
    assert stopped["choices"][0]["finish_reason"] == "stop" and stopped["usage"]["completion_tokens"] == 1
    assert text(stopped) == ""
    held = ask(logit_bias={str(x): 100, str(y): 50}, stop_token_ids=[x], min_tokens=4)
    assert text(held) == " world" * 4 and held["choices"][0]["finish_reason"] == "stop"


def test_server_defaults_for_thinking(qwen3_chat_dir, hf_tokenizer):
    """--chat-template-kwargs turns thinking off for every request (a request may turn it back on);
    --reasoning-parser none keeps the raw text."""
    srv = start_server(qwen3_chat_dir, "--chat-template-kwargs", '{"enable_thinking": false}',
                       "--reasoning-parser", "none", "--max-batch", "2")
    try:
        msgs = [{"role": "user", "content": "Hi"}]
        off = srv.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2}).json()
        on = srv.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": 2,
                                                    "chat_template_kwargs": {"enable_thinking": True}}).json()
        assert off["usage"]["prompt_tokens"] == hf_count(hf_tokenizer, msgs, enable_thinking=False)
        assert on["usage"]["prompt_tokens"] == hf_count(hf_tokenizer, msgs, enable_thinking=True)
        assert "reasoning_content" not in off["choices"][0]["message"]
    finally:
        srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)
