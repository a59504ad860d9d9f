"""The OpenAI API through the official `openai` package, unmodified, against real gunicorn."""
from __future__ import annotations

import json
import socket

import pytest

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Hello world! How are you today?"}]
LONG = {"ignore_eos": True}           # random weights: do not let an early EOS shorten a test


def prompt_tokens(server, messages) -> int:
    return server.post("/tokenize", json={"messages": messages}).json()["count"]


def test_models(openai_client, model_id):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [model_id]
    assert openai_client.models.retrieve(model_id).id == model_id


def test_chat_non_streaming(openai_client, idle_server, model_id):
    r = openai_client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=12,
                                              temperature=0, extra_body=LONG)
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == model_id and r.id.startswith("chatcmpl-")
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str) and choice.message.content
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == prompt_tokens(idle_server, MESSAGES)
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_matches_non_streaming(openai_client, model_id):
    kw = dict(model=model_id, messages=MESSAGES, temperature=0, extra_body=LONG)
    full = openai_client.chat.completions.create(max_completion_tokens=16, **kw)
    stream = openai_client.chat.completions.create(max_completion_tokens=16, stream=True,
                                                   stream_options={"include_usage": True}, **kw)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_both_ways(openai_client, model_id):
    kw = dict(model=model_id, prompt="Once upon a time", temperature=0, max_tokens=10, extra_body=LONG)
    full = openai_client.completions.create(**kw)
    assert full.object == "text_completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 10
    parts = list(openai_client.completions.create(stream=True, **kw))
    assert "".join(p.choices[0].text for p in parts if p.choices) == full.choices[0].text
    assert parts[-1].choices[0].finish_reason == "length"


def test_default_max_tokens_for_completions_is_16(openai_client, model_id):
    r = openai_client.completions.create(model=model_id, prompt="Python is", temperature=0, extra_body=LONG)
    assert r.usage.completion_tokens == 16


def test_stop_string_ends_with_stop_and_is_not_emitted(openai_client, model_id):
    kw = dict(model=model_id, messages=MESSAGES, temperature=0, max_tokens=40, extra_body=LONG)
    text = openai_client.chat.completions.create(**kw).choices[0].message.content
    assert len(text) > 12, text
    stop = text[6:10]
    expected = text[: text.find(stop)]
    r = openai_client.chat.completions.create(stop=[stop], **kw)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == expected
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       openai_client.chat.completions.create(stop=stop, stream=True, **kw) if c.choices)
    assert streamed == expected


def test_eos_gives_stop(openai_client, model_id):
    """Without ignore_eos a generation may end on EOS: then finish_reason is "stop", never None."""
    r = openai_client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=64, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert (r.choices[0].finish_reason == "length") == (r.usage.completion_tokens == 64)


def test_seed_reproducible(openai_client, model_id):
    kw = dict(model=model_id, messages=MESSAGES, temperature=1.0, top_p=0.95, max_tokens=24, extra_body=LONG)
    a = openai_client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = openai_client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    c = openai_client.chat.completions.create(seed=99, **kw).choices[0].message.content
    assert a == b
    assert a != c


def test_sampling_parameters_accepted(openai_client, model_id):
    r = openai_client.chat.completions.create(
        model=model_id, messages=MESSAGES, max_tokens=5, temperature=0.7, top_p=0.9, seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True})
    assert r.usage.completion_tokens == 5


def test_chat_logprobs(openai_client, model_id):
    r = openai_client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=3, extra_body=LONG)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob == pytest.approx(tops[0], abs=1e-5)      # greedy picks the best
        assert entry.token == entry.top_logprobs[0].token
    stream = openai_client.chat.completions.create(model=model_id, messages=MESSAGES, max_tokens=6,
                                                   temperature=0, logprobs=True, top_logprobs=2,
                                                   stream=True, extra_body=LONG)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_completion_logprobs(openai_client, model_id):
    r = openai_client.completions.create(model=model_id, prompt="The quick brown", max_tokens=4,
                                         temperature=0, logprobs=2, extra_body=LONG)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text or lp.text_offset[0] == 0


def test_tokenize_detokenize_roundtrip(idle_server):
    text = "The quick brown fox jumps over the lazy dog."
    r = idle_server.post("/tokenize", json={"prompt": text}).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == 2048
    back = idle_server.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == text


def test_raw_sse_framing(idle_server, model_id):
    """The byte-level contract: text/event-stream, `data: {json}` events, `data: [DONE]` last."""
    body = json.dumps({"model": model_id, "messages": MESSAGES, "stream": True, "max_tokens": 3,
                       "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", idle_server.port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Connection: close\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        raw = b""
        while chunk := s.recv(65536):
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0] and b"text/event-stream" in head
    events = [line for line in payload.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"


def test_max_tokens_clamped_to_context(idle_server, model_id):
    prompt = [5] * 2030                    # token ids: 18 tokens of room in the 2,048-token context
    r = idle_server.post("/v1/completions", json={"model": model_id, "prompt": prompt, "max_tokens": 10 ** 6,
                                                 "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == 2030 and 0 < usage["completion_tokens"] <= 18
    assert r.json()["choices"][0]["finish_reason"] == "length"
