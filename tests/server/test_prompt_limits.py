"""A prompt too long for the context is refused before it is tokenized when its length alone
proves it cannot fit (a 50 MB prompt must not hold the interpreter for seconds to be refused),
and after tokenizing otherwise; both are a 400 naming the limit."""
from __future__ import annotations

import pytest

from appliance.server.validation import NORMALIZATION_SLACK, longest_token_chars

MB = 2 ** 20


@pytest.fixture(scope="module")
def app(server_model_dir):
    from appliance.config import Settings
    from appliance.server import create_app

    app = create_app({"settings": Settings(model=str(server_model_dir), max_context=256, max_body_bytes=64 * MB,
                                           sysfs_root="/nonexistent")})
    assert app.extensions["appliance"].ready_event.wait(60)
    yield app
    app.extensions["appliance"].close()


@pytest.fixture
def encoded(app, monkeypatch):
    """The lengths of the texts the tokenizer was asked to encode."""
    tokenizer = app.extensions["appliance"].engine.tokenizer
    lengths, real = [], tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, *a, **kw: lengths.append(len(text)) or real(text, *a, **kw))
    return lengths


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", lambda text: {"prompt": text}),
    ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}]}),
])
def test_a_50_mb_prompt_is_refused_untokenized(app, encoded, path, body):
    r = app.test_client().post(path, json=body("word " * (10 * MB)))
    err = r.json["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", err
    assert "characters long" in err["message"] and "context is 256 tokens" in err["message"]
    assert err["param"] == ("prompt" if path == "/v1/completions" else "messages")
    assert all(n < MB for n in encoded), encoded         # the chat template's probes only, never the prompt


def test_a_prompt_the_bound_cannot_rule_out_is_tokenized_then_refused(app, encoded):
    tokenizer = app.extensions["appliance"].engine.tokenizer
    text = "word " * 300                                  # ~300+ tokens, far below the length bound
    assert len(text) < 256 * longest_token_chars(tokenizer) * NORMALIZATION_SLACK
    r = app.test_client().post("/v1/completions", json={"prompt": text})
    err = r.json["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    n = len(tokenizer.encode(text))
    assert f"the prompt is {n} tokens long" in err["message"] and "256 tokens" in err["message"]
    assert len(text) in encoded


def test_the_bound_is_a_true_lower_bound(app):
    """No text of the vocabulary's own tokens has fewer tokens than the bound says."""
    tokenizer = app.extensions["appliance"].engine.tokenizer
    longest = longest_token_chars(tokenizer)
    pieces = [tokenizer.decode([i]) for i in range(min(tokenizer.vocab_size, 2000))]
    text = "".join(sorted(pieces, key=len, reverse=True)[:200])
    assert len(tokenizer.encode(text)) >= len(text) // longest
