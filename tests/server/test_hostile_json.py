"""Hostile bodies against the live server: each is a 4xx with a JSON error naming the problem,
never a 500, and the server serves normally afterwards."""
from __future__ import annotations

import json

import pytest
import requests

from appliance.server.errors import APIError
from appliance.server.json_body import MAX_DEPTH, parse_json_object

C, P = "/v1/chat/completions", "/v1/completions"
LONE = '"a\\ud800b"'                         # the JSON text of a string holding a lone surrogate
DEEP = 50_000


def chat_with(content_json: str, **extra) -> str:
    rest = "".join(f', "{k}": {json.dumps(v)}' for k, v in extra.items())
    return '{"messages": [{"role": "user", "content": ' + content_json + "}]" + rest + "}"


# (name, path, body, headers, status, words the message must contain, param or None)
CASES = [
    ("surrogate in chat content", C, chat_with(LONE), {}, 400, ["lone surrogate"], "messages[0].content"),
    ("surrogate in a text part", C, chat_with('[{"type": "text", "text": ' + LONE + "}]"), {}, 400,
     ["lone surrogate"], "messages[0].content[0].text"),
    ("surrogate while streaming", C, chat_with(LONE, stream=True), {}, 400, ["lone surrogate"],
     "messages[0].content"),
    ("surrogate in a completion prompt", P, '{"prompt": ' + LONE + "}", {}, 400, ["lone surrogate"], "prompt"),
    ("surrogate in a stop string", P, '{"prompt": "hi", "stop": [' + LONE + "]}", {}, 400, ["lone surrogate"],
     "stop[0]"),
    ("low surrogate alone", P, '{"prompt": "\\udc00"}', {}, 400, ["lone surrogate"], "prompt"),
    ("surrogate in a key", C, '{"messages": [{"role": "user", "content": "hi", "x\\ud800": 1}]}', {}, 400,
     ["lone surrogate", "key"], "messages[0]"),
    ("surrogate in tokenize", "/tokenize", '{"prompt": ' + LONE + "}", {}, 400, ["lone surrogate"], "prompt"),
    ("surrogate in tokenize messages", "/tokenize", chat_with(LONE), {}, 400, ["lone surrogate"],
     "messages[0].content"),
    ("surrogate in the model name", C, chat_with('"hi"', model="m\ud800"), {}, 400, ["lone surrogate"], "model"),
    # as deep as the test server's 64 KiB body limit allows (50,000 levels: below, in process)
    ("arrays 30,000 deep", C, '{"messages": ' + "[" * 30_000 + "]" * 30_000 + "}", {}, 400, ["nested"], None),
    ("objects 10,000 deep", P, '{"prompt": "hi", "x": ' + '{"a":' * 10_000 + "1" + "}" * 10_000 + "}", {}, 400,
     ["nested"], None),
    ("arrays past the depth limit", P, '{"prompt": "hi", "logit_bias": ' + "[" * (MAX_DEPTH + 5) + "]" *
     (MAX_DEPTH + 5) + "}", {}, 400, ["nested", str(MAX_DEPTH)], "logit_bias"),
    ("a float past 64 bits", C, chat_with('"hi"')[:-1] + ', "temperature": 1e400}', {}, 400,
     ["1e400", "out of range"], None),
    ("an integer past 64 bits", P, '{"prompt": "hi", "max_tokens": 100000000000000000000000}', {}, 400,
     ["out of range"], None),
    ("an integer of 5,000 digits", P, '{"prompt": "hi", "seed": ' + "7" * 5000 + "}", {}, 400,
     ["out of range"], None),
    ("NaN", P, '{"prompt": "hi", "temperature": NaN}', {}, 400, ["NaN"], None),
    ("Infinity", P, '{"prompt": "hi", "top_p": Infinity}', {}, 400, ["Infinity"], None),
    ("-Infinity", P, '{"prompt": "hi", "presence_penalty": -Infinity}', {}, 400, ["Infinity"], None),
    ("a top-level array", C, "[1, 2]", {}, 400, ["object", "array"], None),
    ("a top-level number", C, "42", {}, 400, ["object", "integer"], None),
    ("a top-level string", P, '"hello"', {}, 400, ["object", "string"], None),
    ("invalid UTF-8", C, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', {}, 400, ["UTF-8", "byte"],
     None),
    ("UTF-8-encoded surrogate", P, b'{"prompt": "\xed\xa0\x80"}', {}, 400, ["UTF-8"], None),
    ("XML content type", C, chat_with('"hi"'), {"Content-Type": "application/xml"}, 415, ["application/xml"],
     None),
    ("multipart content type", P, '{"prompt": "hi"}', {"Content-Type": "multipart/form-data; boundary=x"}, 415,
     ["multipart/form-data"], None),
    ("a charset other than UTF-8", P, '{"prompt": "hi"}', {"Content-Type": "application/json; charset=latin-1"},
     415, ["latin-1"], None),
]


@pytest.mark.parametrize("name, path, body, headers, status, words, param", CASES, ids=[c[0] for c in CASES])
def test_hostile_body(server, name, path, body, headers, status, words, param):
    data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
    r = requests.post(server.base + path, data=data, timeout=30,
                      headers={"Content-Type": "application/json", **headers})
    assert r.status_code == status, (name, r.status_code, r.text[:500])
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    for word in words:
        assert word in err["message"], (word, err)
    if param is not None:
        assert err["param"] == param, err


def test_server_serves_after_the_hostile_bodies(server, model_id):
    for _, path, body, headers, _, _, _ in CASES:
        data = body.encode("utf-8", "surrogatepass") if isinstance(body, str) else body
        requests.post(server.base + path, data=data, headers=headers, timeout=30)
    r = server.post(C, json={"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200
    assert server.health()["status"] == "ready"


def test_paired_surrogates_and_escaped_backslashes_are_fine():
    """A surrogate pair is one character; "\\\\ud800" is a backslash and text: both pass."""
    body = parse_json_object(b'{"a": "\\ud83d\\ude00", "b": "\\\\ud800", "c": 1e308, "d": -9223372036854775808}')
    assert body == {"a": "\U0001F600", "b": "\\ud800", "c": 1e308, "d": -(2 ** 63)}


def nested(depth: int) -> bytes:
    return ("{\"a\": " + "[" * depth + "]" * depth + "}").encode()


def test_nesting_up_to_the_limit_is_accepted():
    depth = MAX_DEPTH - 1                     # the body object itself is one level
    assert json.dumps(parse_json_object(nested(depth))).count("[") == depth
    with pytest.raises(APIError, match="nested"):
        parse_json_object(nested(depth + 1))


@pytest.mark.parametrize("text", ["[" * DEEP + "]" * DEEP, '{"a":' * DEEP + "1" + "}" * DEEP])
def test_50000_levels_deep_is_a_400(text):
    with pytest.raises(APIError, match="nested too deeply") as e:
        parse_json_object(('{"x": ' + text + "}").encode())
    assert e.value.status == 400
