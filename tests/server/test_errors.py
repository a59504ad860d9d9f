"""Malformed requests, sent as raw HTTP: each gets a 4xx and an OpenAI-shaped JSON error,
and the server stays healthy."""
from __future__ import annotations

import json

import pytest
import requests

USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return json.dumps({"messages": USER, **fields})


def comp(**fields):
    return json.dumps({"prompt": "hi", **fields})


FN = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def tool(**fn):
    return {"type": "function", "function": {**FN, **fn}}


SCHEMA_PARAM = "response_format.json_schema.schema"


def schema(s):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": s}}


C, P = "/v1/chat/completions", "/v1/completions"
LONG_PROMPT = "Hello world! " * 1200          # ~3,600 tokens against a 2,048-token context

# (name, method, path, body (str | bytes | None), expected status, expected param or None)
CASES = [
    ("truncated json", "POST", C, '{"messages": [', 400, None),
    ("empty body", "POST", C, "", 400, None),
    ("array body", "POST", C, "[]", 400, None),
    ("null body", "POST", C, "null", 400, None),
    ("string body", "POST", C, '"hello"', 400, None),
    ("not utf-8", "POST", C, b"\xff\xfe\xfd", 400, None),
    ("NaN literal", "POST", C, '{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None),
    ("messages missing", "POST", C, "{}", 400, "messages"),
    ("messages not a list", "POST", C, json.dumps({"messages": "hi"}), 400, "messages"),
    ("messages empty", "POST", C, json.dumps({"messages": []}), 400, "messages"),
    ("message not an object", "POST", C, json.dumps({"messages": [1]}), 400, "messages[0]"),
    ("role missing", "POST", C, json.dumps({"messages": [{"content": "x"}]}), 400, "messages[0].role"),
    ("role unknown", "POST", C, json.dumps({"messages": [{"role": "wizard", "content": "x"}]}), 400, "messages[0].role"),
    ("content missing", "POST", C, json.dumps({"messages": [{"role": "user"}]}), 400, "messages[0].content"),
    ("content a number", "POST", C, json.dumps({"messages": [{"role": "user", "content": 5}]}), 400,
     "messages[0].content"),
    ("content image part", "POST", C, json.dumps({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}), 400, "messages[0].content[0]"),
    ("model not a string", "POST", C, chat(model=123), 400, "model"),
    ("model unknown", "POST", C, chat(model="gpt-4o"), 404, "model"),
    ("temperature a string", "POST", C, chat(temperature="hot"), 400, "temperature"),
    ("temperature negative", "POST", C, chat(temperature=-0.5), 400, "temperature"),
    ("temperature too high", "POST", C, chat(temperature=2.5), 400, "temperature"),
    ("top_p zero", "POST", C, chat(top_p=0), 400, "top_p"),
    ("top_p above one", "POST", C, chat(top_p=1.5), 400, "top_p"),
    ("top_k below -1", "POST", C, chat(top_k=-2), 400, "top_k"),
    ("top_k fractional", "POST", C, chat(top_k=1.5), 400, "top_k"),
    ("min_p above one", "POST", C, chat(min_p=2), 400, "min_p"),
    ("repetition_penalty zero", "POST", C, chat(repetition_penalty=0), 400, "repetition_penalty"),
    ("presence_penalty out of range", "POST", C, chat(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty a string", "POST", C, chat(frequency_penalty="x"), 400, "frequency_penalty"),
    ("max_tokens zero", "POST", C, chat(max_tokens=0), 400, "max_tokens"),
    ("max_tokens a string", "POST", C, chat(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens a boolean", "POST", C, chat(max_tokens=True), 400, "max_tokens"),
    ("max_completion_tokens negative", "POST", C, chat(max_completion_tokens=-5), 400, "max_completion_tokens"),
    ("n two", "POST", C, chat(n=2), 400, "n"),
    ("stop a number", "POST", C, chat(stop=5), 400, "stop"),
    ("stop five strings", "POST", C, chat(stop=["a", "b", "c", "d", "e"]), 400, "stop"),
    ("stop empty string", "POST", C, chat(stop=[""]), 400, "stop"),
    ("seed a string", "POST", C, chat(seed="x"), 400, "seed"),
    ("logprobs a string", "POST", C, chat(logprobs="yes"), 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", C, chat(top_logprobs=3), 400, "top_logprobs"),
    ("top_logprobs too many", "POST", C, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("stream a string", "POST", C, chat(stream="true"), 400, "stream"),
    ("stream_options without stream", "POST", C, chat(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("include_usage not a boolean", "POST", C, chat(stream=True, stream_options={"include_usage": "y"}), 400,
     "include_usage"),
    ("tools not an array", "POST", C, chat(tools={"type": "function"}), 400, "tools"),
    ("tool not an object", "POST", C, chat(tools=["get_weather"]), 400, "tools[0]"),
    ("tool type unknown", "POST", C, chat(tools=[{"type": "retrieval", "function": FN}]), 400, "tools[0].type"),
    ("tool without function", "POST", C, chat(tools=[{"type": "function"}]), 400, "tools[0].function"),
    ("tool name with spaces", "POST", C, chat(tools=[tool(name="get weather")]), 400, "tools[0].function.name"),
    ("tool name missing", "POST", C, chat(tools=[{"type": "function", "function": {"parameters": {}}}]), 400,
     "tools[0].function.name"),
    ("tool declared twice", "POST", C, chat(tools=[tool(), tool()]), 400, "tools[1].function.name"),
    ("tool parameters not a schema", "POST", C, chat(tools=[tool(parameters="city: str")]), 400,
     "tools[0].function.parameters"),
    ("tool parameters not an object schema", "POST", C, chat(tools=[tool(parameters={"type": "string"})]), 400,
     "tools[0].function.parameters"),
    ("tool parameters required not a list", "POST", C,
     chat(tools=[tool(parameters={"type": "object", "required": "city"})]), 400,
     "tools[0].function.parameters.required"),
    ("tool description a number", "POST", C, chat(tools=[tool(description=5)]), 400,
     "tools[0].function.description"),
    ("tool_choice unknown word", "POST", C, chat(tools=[tool()], tool_choice="always"), 400, "tool_choice"),
    ("tool_choice unknown function", "POST", C, chat(tools=[tool()], tool_choice={
        "type": "function", "function": {"name": "get_time"}}), 400, "tool_choice"),
    ("tool_choice without tools", "POST", C, chat(tool_choice="required"), 400, "tool_choice"),
    ("tool_choice malformed", "POST", C, chat(tools=[tool()], tool_choice={"name": "get_weather"}), 400,
     "tool_choice"),
    ("parallel_tool_calls a string", "POST", C, chat(tools=[tool()], parallel_tool_calls="no"), 400,
     "parallel_tool_calls"),
    ("history tool_calls not an array", "POST", C, json.dumps({"messages": [
        {"role": "assistant", "content": None, "tool_calls": {"id": "x"}}]}), 400, "messages[0].tool_calls"),
    ("history tool call without name", "POST", C, json.dumps({"messages": [USER[0],
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"arguments": "{}"}}]}]}), 400,
     "messages[1].tool_calls[0].function.name"),
    ("history tool call arguments a number", "POST", C, json.dumps({"messages": [USER[0],
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "f", "arguments": 3}}]}]}), 400,
     "messages[1].tool_calls[0].function.arguments"),
    ("tool message without tool_call_id", "POST", C, json.dumps({"messages": [USER[0],
        {"role": "tool", "content": "18 degrees"}]}), 400, "messages[1].tool_call_id"),
    ("tool message content null", "POST", C, json.dumps({"messages": [USER[0],
        {"role": "tool", "tool_call_id": "c1", "content": None}]}), 400, "messages[1].content"),
    ("reasoning_content a number", "POST", C, json.dumps({"messages": [USER[0],
        {"role": "assistant", "content": "4", "reasoning_content": 4}, USER[0]]}), 400,
     "messages[1].reasoning_content"),
    ("message name a number", "POST", C, json.dumps({"messages": [{"role": "user", "content": "hi", "name": 7}]}),
     400, "messages[0].name"),
    ("chat_template_kwargs a string", "POST", C, chat(chat_template_kwargs="enable_thinking=false"), 400,
     "chat_template_kwargs"),
    ("chat_template_kwargs replaces messages", "POST", C, chat(chat_template_kwargs={"messages": []}), 400,
     "chat_template_kwargs.messages"),
    ("max_thinking_tokens negative", "POST", C, chat(max_thinking_tokens=-1), 400, "max_thinking_tokens"),
    ("max_thinking_tokens a string", "POST", C, chat(max_thinking_tokens="64"), 400, "max_thinking_tokens"),
    ("max_thinking_tokens without thought tags", "POST", C, chat(max_thinking_tokens=64), 400,
     "max_thinking_tokens"),
    ("logit_bias an array", "POST", C, chat(logit_bias=[[5, 1.0]]), 400, "logit_bias"),
    ("logit_bias key not a token id", "POST", C, chat(logit_bias={"hello": 1}), 400, "logit_bias"),
    ("logit_bias key past vocab", "POST", C, chat(logit_bias={"99999999": 1}), 400, "logit_bias"),
    ("logit_bias key negative", "POST", C, chat(logit_bias={"-3": 1}), 400, "logit_bias"),
    ("logit_bias value too large", "POST", C, chat(logit_bias={"5": 101}), 400, "logit_bias"),
    ("logit_bias value a string", "POST", C, chat(logit_bias={"5": "ban"}), 400, "logit_bias"),
    ("min_tokens negative", "POST", C, chat(min_tokens=-1), 400, "min_tokens"),
    ("min_tokens above max_tokens", "POST", C, chat(min_tokens=10, max_tokens=5), 400, "min_tokens"),
    ("stop_token_ids a number", "POST", C, chat(stop_token_ids=2), 400, "stop_token_ids"),
    ("stop_token_ids past vocab", "POST", C, chat(stop_token_ids=[10 ** 8]), 400, "stop_token_ids"),
    ("completion logit_bias past vocab", "POST", P, comp(logit_bias={"99999999": -100}), 400, "logit_bias"),
    ("tokenize bad tools", "POST", "/tokenize", json.dumps({"messages": USER, "tools": [{"type": "x"}]}), 400,
     "tools[0].type"),
    ("tokenize bad template kwargs", "POST", "/tokenize", json.dumps({"messages": USER,
                                                                      "chat_template_kwargs": [1]}), 400,
     "chat_template_kwargs"),
    ("response_format not an object", "POST", C, chat(response_format="json"), 400, "response_format"),
    ("response_format type unknown", "POST", C, chat(response_format={"type": "xml"}), 400, "response_format.type"),
    ("json_schema not an object", "POST", C, chat(response_format={"type": "json_schema", "json_schema": "x"}), 400,
     "response_format.json_schema"),
    ("json_schema strict not a boolean", "POST", C, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object"}, "strict": "yes"}}), 400, "response_format.json_schema.strict"),
    ("schema with an unknown type", "POST", C, chat(response_format=schema({"type": "foo"})), 400, SCHEMA_PARAM),
    ("schema with an unsupported keyword", "POST", C, chat(response_format=schema(
        {"type": "object", "propertyNames": {"pattern": "^a"}})), 400, SCHEMA_PARAM),
    ("schema pattern with a lookahead", "POST", C, chat(response_format=schema(
        {"type": "string", "pattern": "(?=a)b"})), 400, SCHEMA_PARAM),
    ("schema with an unknown format", "POST", C, chat(response_format=schema(
        {"type": "string", "format": "no-such-format"})), 400, SCHEMA_PARAM),
    ("schema minimum not a number", "POST", C, chat(response_format=schema({"type": "integer", "minimum": "0"})), 400,
     SCHEMA_PARAM),
    ("schema not an object", "POST", C, chat(response_format=schema([1, 2])), 400, SCHEMA_PARAM),
    ("structured_outputs two kinds", "POST", C, chat(structured_outputs={"regex": "a", "choice": ["b"]}), 400,
     "structured_outputs"),
    ("structured_outputs none", "POST", C, chat(structured_outputs={}), 400, "structured_outputs"),
    ("structured_outputs regex invalid", "POST", C, chat(structured_outputs={"regex": "[a-"}), 400,
     "structured_outputs.regex"),
    ("structured_outputs choice empty", "POST", C, chat(structured_outputs={"choice": []}), 400,
     "structured_outputs.choice"),
    ("structured_outputs lark with an unknown rule", "POST", C, chat(structured_outputs={"grammar": "start: foo"}),
     400, "structured_outputs.grammar"),
    ("guided_grammar GBNF broken", "POST", C, chat(guided_grammar='root ::= "a" | ('), 400, "guided_grammar"),
    ("guided_json not a schema", "POST", C, chat(guided_json={"type": 5}), 400, "guided_json"),
    ("guided_regex a number", "POST", C, chat(guided_regex=5), 400, "guided_regex"),
    ("json_schema field not JSON", "POST", C, chat(json_schema="{nope"), 400, "json_schema"),
    ("two structured outputs", "POST", C, chat(response_format={"type": "json_object"}, guided_regex="a"), 400,
     "guided_regex"),
    ("required tool with a schema that cannot be enforced", "POST", C, chat(tools=[tool(parameters={
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)"}}})], tool_choice="required"), 400,
     "tools[0].function.parameters"),
    ("a regex beside tools", "POST", C, chat(tools=[tool()], structured_outputs={"regex": "a+"}), 400,
     "structured_outputs.regex"),
    ("completion schema with an unknown type", "POST", P, comp(response_format=schema({"type": "foo"})), 400,
     SCHEMA_PARAM),
    ("completion grammar invalid", "POST", P, comp(grammar="start: ("), 400, "grammar"),
    ("chat prompt longer than context", "POST", C, json.dumps({"messages": [{"role": "user", "content": LONG_PROMPT}]}),
     400, "messages"),
    ("completion prompt missing", "POST", P, "{}", 400, "prompt"),
    ("completion prompt a number", "POST", P, json.dumps({"prompt": 12}), 400, "prompt"),
    ("completion prompt empty", "POST", P, json.dumps({"prompt": ""}), 400, "prompt"),
    ("completion token id negative", "POST", P, json.dumps({"prompt": [1, -1]}), 400, "prompt"),
    ("completion token id past vocab", "POST", P, json.dumps({"prompt": [10 ** 9]}), 400, "prompt"),
    ("completion several prompts", "POST", P, json.dumps({"prompt": ["a", "b"]}), 400, "prompt"),
    ("completion echo", "POST", P, comp(echo=True), 400, "echo"),
    ("completion suffix", "POST", P, comp(suffix="x"), 400, "suffix"),
    ("completion logprobs too many", "POST", P, comp(logprobs=6), 400, "logprobs"),
    ("completion best_of", "POST", P, comp(best_of=3), 400, "best_of"),
    ("completion prompt longer than context", "POST", P, json.dumps({"prompt": LONG_PROMPT}), 400, "prompt"),
    ("tokenize nothing", "POST", "/tokenize", "{}", 400, "prompt"),
    ("tokenize a number", "POST", "/tokenize", json.dumps({"prompt": 5}), 400, "prompt"),
    ("detokenize strings", "POST", "/detokenize", json.dumps({"tokens": "abc"}), 400, "tokens"),
    ("detokenize past vocab", "POST", "/detokenize", json.dumps({"tokens": [99999999]}), 400, "tokens"),
    ("wrong method", "GET", C, None, 405, None),
    ("unknown endpoint", "POST", "/v1/moderations", chat(), 404, None),
    ("unknown model card", "GET", "/v1/models/nope", None, 404, "model"),
    ("oversized body", "POST", C, json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]}), 413, None),
]


def test_table_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name, method, path, body, status, param", CASES, ids=[c[0] for c in CASES])
def test_malformed_request(server, name, method, path, body, status, param):
    data = body.encode() if isinstance(body, str) else body
    headers = {"Content-Type": "application/json"}
    r = requests.request(method, server.base + path, data=data, headers=headers, timeout=30)
    assert r.status_code == status, (name, r.status_code, r.text)
    assert r.headers["Content-Type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:            # exact, or a field inside it ("messages[0].content[0]" -> ".type")
        assert err["param"] == param or err["param"].startswith(param + "."), err


def test_context_error_names_both_numbers(server):
    r = requests.post(server.base + C, json={"messages": [{"role": "user", "content": LONG_PROMPT}]}, timeout=30)
    err = r.json()["error"]
    n_prompt = server.post("/tokenize", json={"messages": [{"role": "user", "content": LONG_PROMPT}]}).json()["count"]
    assert err["code"] == "context_length_exceeded"
    assert f"{n_prompt} tokens" in err["message"] and "2048 tokens" in err["message"]


def test_form_encoded_json_is_accepted(idle_server, model_id):
    """curl -d sends application/x-www-form-urlencoded: the body is still read as JSON."""
    r = requests.post(idle_server.base + P, data=comp(model=model_id, max_tokens=2), timeout=30,
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


def test_server_healthy_after_the_table(server, model_id):
    for _, method, path, body, _, _ in CASES:     # the whole table once more, back to back
        requests.request(method, server.base + path, data=body, timeout=30)
    assert server.health()["status"] == "ready"
    r = server.post(C, json={"model": model_id, "messages": USER, "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["role"] == "assistant"
    assert server.wait_idle()["kv_blocks_used"] == 0
    m = server.metrics()
    assert m[("appliance_requests_total", (("outcome", "invalid"),))] >= 30
