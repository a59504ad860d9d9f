"""Structured output through the server: on a tiny checkpoint with random weights (whose free text
is noise) every reply parses and validates, streaming or not; tool_choice "required" always
gives a declared function with valid arguments; the other grammar shapes peers use."""
from __future__ import annotations

import json
import re
import shutil
from typing import Literal

import jsonschema
import pytest

from live_server import start_server

OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    ("nested objects", {**OBJ, "required": ["user"], "properties": {"user": {
        **OBJ, "required": ["name", "id"], "properties": {"name": {"type": "string", "maxLength": 10},
                                                          "id": {"type": "integer", "minimum": 1,
                                                                 "maximum": 9999}}}}}),
    ("array with min and max items", {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "minItems": 2, "maxItems": 4}),
    ("enums", {**OBJ, "required": ["color", "size"], "properties": {"color": {"enum": ["red", "green", "blue"]},
                                                                     "size": {"enum": ["S", "M", "L"]}}}),
    ("integers with bounds", {**OBJ, "required": ["year", "count"], "properties": {
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}}}),
    ("required and optional fields", {**OBJ, "required": ["a"], "properties": {
        "a": {"type": "string", "maxLength": 8}, "b": {"type": "boolean"},
        "c": {"type": "integer", "minimum": 0, "maximum": 5}}}),
    ("anyOf", {"anyOf": [
        {**OBJ, "required": ["kind", "r"], "properties": {"kind": {"const": "circle"},
                                                          "r": {"type": "integer", "minimum": 1, "maximum": 9}}},
        {**OBJ, "required": ["kind", "side"], "properties": {"kind": {"const": "square"},
                                                             "side": {"type": "integer", "minimum": 1,
                                                                      "maximum": 9}}}]}),
    ("strings with a pattern", {**OBJ, "required": ["code", "email"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}}}),
    ("unicode", {**OBJ, "required": ["greeting", "city"], "properties": {
        "greeting": {"enum": ["Grüß Gott", "こんにちは", "Привет", "¡Hola! 👋"]},
        "city": {"type": "string", "maxLength": 6}}}),
    ("array of objects", {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        **OBJ, "required": ["sku", "qty"], "properties": {"sku": {"type": "string", "pattern": "^[0-9]{4}$"},
                                                          "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}}),
    ("booleans and null", {**OBJ, "required": ["ok", "err", "note"], "properties": {
        "ok": {"type": "boolean"}, "err": {"type": "null"}, "note": {"type": ["string", "null"], "maxLength": 10}}}),
    ("const and a string array", {**OBJ, "required": ["version", "items"], "properties": {
        "version": {"const": "1.0"}, "items": {"type": "array", "maxItems": 3,
                                               "items": {"type": "string", "maxLength": 5}}}}),
    ("nested arrays", {"type": "array", "minItems": 2, "maxItems": 2, "items": {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}),
    ("$defs and $ref", {"$defs": {"pt": {**OBJ, "required": ["x", "y"], "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        **OBJ, "required": ["from", "to"], "properties": {"from": {"$ref": "#/$defs/pt"},
                                                          "to": {"$ref": "#/$defs/pt"}}}),
    ("a date format", {**OBJ, "required": ["day"], "properties": {"day": {"type": "string", "format": "date"}}}),
]
MESSAGES = [{"role": "user", "content": "Fill in the form."}]
# A random model that opens a thought never closes it: these requests answer straight away
# (the test of thinking first gives the thought a budget).
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {**OBJ, "required": ["city"], "properties": {
                                                "city": {"type": "string", "maxLength": 12},
                                                "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
SENSOR = {"type": "function", "function": {"name": "read_board_sensor", "parameters": {
    **OBJ, "required": ["sensor"], "properties": {"sensor": {"enum": ["soc", "bigcore0", "gpu"]}}}}}
TOOLS = [WEATHER, SENSOR]


@pytest.fixture(scope="module")
def demo_server():
    """The embedded demo model, thinking off for every request (the schema table as on a board)."""
    srv = start_server(None, "--max-batch", "4", "--chat-template-kwargs", '{"enable_thinking": false}')
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)


@pytest.fixture(params=["random", "demo"])
def any_server(request):
    srv = request.getfixturevalue("chat_server" if request.param == "random" else "demo_server")
    srv.wait_idle()
    return srv


def chat(server, **body):
    r = server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 400, **NO_THINKING, **body})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def stream_chat(server, **body):
    r = server.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 200, "stream": True,
                                                  **NO_THINKING, **body}, stream=True)
    assert r.status_code == 200, r.text
    content, finish, calls = "", None, {}
    for line in r.iter_lines(decode_unicode=True):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        for c in json.loads(line[6:])["choices"]:
            content += c["delta"].get("content") or ""
            for t in c["delta"].get("tool_calls") or []:
                call = calls.setdefault(t["index"], {"name": "", "arguments": ""})
                call["name"] += t.get("function", {}).get("name") or ""
                call["arguments"] += t.get("function", {}).get("arguments") or ""
            finish = c["finish_reason"] or finish
    return content, finish, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("name, schema", SCHEMAS, ids=[s[0] for s in SCHEMAS])
def test_every_reply_parses_and_validates(any_server, name, schema):
    rf = {"type": "json_schema", "json_schema": {"name": "form", "schema": schema, "strict": True}}
    choice = chat(any_server, response_format=rf, temperature=0)
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    content, finish, _ = stream_chat(any_server, response_format=rf, temperature=1.0, seed=7)
    assert finish == "stop"
    jsonschema.validate(json.loads(content), schema)


def test_table_is_large_enough():
    assert len(SCHEMAS) >= 12


def test_json_object_mode_on_chat_and_completions(any_server):
    """Any JSON object: its keys and strings are free, so noise may run out of tokens inside one
    (then "length"); every reply that ends is an object."""
    stopped = 0
    for seed in range(4):
        choice = chat(any_server, response_format={"type": "json_object"}, temperature=1.0, seed=seed)
        r = any_server.post("/v1/completions", json={"prompt": "JSON:", "max_tokens": 200, "temperature": 1.0,
                                                     "seed": seed, "response_format": {"type": "json_object"}})
        for text, finish in ((choice["message"]["content"], choice["finish_reason"]),
                             (r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"])):
            assert text.startswith("{")
            if finish == "stop":
                assert isinstance(json.loads(text), dict)
                stopped += 1
    assert stopped >= 2


@pytest.mark.parametrize("seed", range(6))
def test_required_tool_call_is_a_declared_function_with_valid_arguments(chat_server, seed):
    choice = chat(chat_server, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
    assert choice["finish_reason"] == "tool_calls"
    calls = choice["message"]["tool_calls"]
    assert calls and all(c["id"].startswith("call_") for c in calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for c in calls:
        jsonschema.validate(json.loads(c["function"]["arguments"]), schemas[c["function"]["name"]])


def test_named_tool_choice_and_one_call_only(chat_server):
    for seed in range(3):
        choice = chat(chat_server, tools=TOOLS, temperature=1.0, seed=seed, parallel_tool_calls=False,
                      tool_choice={"type": "function", "function": {"name": "read_board_sensor"}})
        calls = choice["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["read_board_sensor"]
        assert json.loads(calls[0]["function"]["arguments"])["sensor"] in ("soc", "bigcore0", "gpu")


def test_streamed_required_call_reassembled_by_the_sdk(chat_client):
    stream = chat_client.chat.completions.create(model="qwen3-tiny", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                 tool_choice="required", stream=True, temperature=1.0, seed=3,
                                                 extra_body=NO_THINKING)
    from openai.lib.streaming.chat import ChatCompletionStreamState
    state = ChatCompletionStreamState()
    for chunk in stream:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    call = final.message.tool_calls[0]
    assert call.function.name in ("get_weather", "read_board_sensor")
    json.loads(call.function.arguments)


def test_langchain_agent_gets_tool_calls(chat_server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def read_board_sensor(sensor: Literal["soc", "bigcore0", "gpu"]) -> str:
        """Read one of the board's temperature sensors."""
        return "47.5"

    llm = ChatOpenAI(base_url=chat_server.base + "/v1", api_key="not-needed", model="qwen3-tiny",
                     temperature=0.7, seed=5, max_tokens=200, max_retries=0, timeout=60)
    msg = llm.bind_tools([read_board_sensor], tool_choice="required").invoke(
        "How warm is the soc?", extra_body=NO_THINKING)
    assert msg.tool_calls and {c["name"] for c in msg.tool_calls} == {"read_board_sensor"}
    assert all(c["args"]["sensor"] in ("soc", "bigcore0", "gpu") and c["id"] for c in msg.tool_calls)


@pytest.mark.parametrize("field, value, check", [
    ("structured_outputs", {"regex": "[A-Z]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
    ("structured_outputs", {"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
    ("structured_outputs", {"grammar": 'start: "go " DIR\nDIR: "north" | "south"'},
     lambda t: t in ("go north", "go south")),
    ("structured_outputs", {"json": {"type": "array", "items": {"enum": [1, 2]}, "maxItems": 2}},
     lambda t: all(v in (1, 2) for v in json.loads(t))),
    ("guided_choice", ["left", "right"], lambda t: t in ("left", "right")),
    ("guided_regex", "[0-9]{4}", lambda t: re.fullmatch("[0-9]{4}", t)),
    ("grammar", 'root ::= "on" | "off"', lambda t: t in ("on", "off")),                    # llama.cpp's GBNF
    ("json_schema", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                     "required": ["n"], "additionalProperties": False},
     lambda t: 0 <= json.loads(t)["n"] <= 9),                                             # llama.cpp's field
])
def test_other_shapes_on_both_endpoints(chat_server, field, value, check):
    choice = chat(chat_server, temperature=1.0, seed=1, **{field: value})
    assert check(choice["message"]["content"]), choice
    r = chat_server.post("/v1/completions", json={"prompt": "Answer:", "max_tokens": 100, "temperature": 1.0,
                                                  "seed": 2, field: value}).json()
    assert check(r["choices"][0]["text"]), r


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(chat_server):
    schema = {**OBJ, "required": ["essay"], "properties": {"essay": {"type": "string", "minLength": 200}}}
    choice = chat(chat_server, max_tokens=10, response_format={"type": "json_schema",
                                                               "json_schema": {"name": "e", "schema": schema}})
    assert choice["finish_reason"] == "length" and re.match(r'\{\s*"essay"', choice["message"]["content"])


def test_thinking_first_then_the_answer_is_held_to_the_schema(chat_server, qwen3_chat_dir):
    """Thinking on: the thought is free (this random model is made to open one), the budget
    closes it, the answer after it validates, and the thought is in reasoning_content."""
    tok = json.loads((qwen3_chat_dir / "tokenizer.json").read_text())
    think = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<think>")
    schema = SCHEMAS[2][1]
    choice = chat(chat_server, chat_template_kwargs={"enable_thinking": True}, logit_bias={str(think): 100},
                  max_thinking_tokens=4, temperature=0, tools=None,
                  response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
    assert choice["message"]["reasoning_content"] == "<think>" * 4
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
    call = chat(chat_server, chat_template_kwargs={"enable_thinking": True}, logit_bias={str(think): 100},
                max_thinking_tokens=2, temperature=0, tools=TOOLS, tool_choice="required")
    assert call["finish_reason"] == "tool_calls" and call["message"]["reasoning_content"] == "<think>" * 2


def test_auto_with_a_json_answer_is_a_call_or_the_answer(chat_server):
    """tool_choice auto beside a JSON schema: whichever the model starts, it is held to its schema."""
    schema = SCHEMAS[2][1]
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for seed in range(4):
        choice = chat(chat_server, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=seed,
                      response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}})
        if choice["finish_reason"] == "tool_calls":
            for call in choice["message"]["tool_calls"]:
                fn = call["function"]
                jsonschema.validate(json.loads(fn["arguments"]), tools[fn["name"]])
        else:
            assert choice["finish_reason"] == "stop", choice
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
