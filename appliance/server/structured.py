"""Structured output requests -> a checked grammar for the engine (appliance/engine/grammar.py).

The shapes peers use, one per request:
  response_format    OpenAI: {"type": "json_object"} or {"type": "json_schema", "json_schema":
                     {"name", "schema", "strict"}} ({"type": "text"} asks for nothing)
  structured_outputs vLLM: {"json": schema} | {"json_object": true} | {"regex": "..."} |
                     {"choice": ["a", "b"]} | {"grammar": "<Lark or GBNF>"}
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older top-level fields
  json_schema, grammar                                       llama.cpp server's fields (GBNF)
and, for chat with tools, tool_choice "required" or a named function: the reply is a call in
the model's own tool-call syntax whose arguments validate against the function's parameters;
with "auto" a call the model starts is held to its function's schema. A schema or grammar
llguidance cannot enforce is a 400 naming the field and the problem.
"""
from __future__ import annotations

import json
from typing import Any

from appliance.server.chat import ToolChoice, bad, kind
from appliance.server.errors import APIError

# (field, what it is) in the order they are looked for
_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar", "json_schema", "grammar")
_STRUCTURED_KEYS = ("json", "json_object", "regex", "choice", "grammar")
EMPTY_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def _compile(what: str, value: Any, param: str, tokenizer):
    from appliance.engine import grammar

    try:
        if what == "json_schema":
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as e:
                    raise grammar.GrammarError(f"not JSON ({e})") from None
            return grammar.json_schema(value, tokenizer)
        if what == "json_object":
            return grammar.json_object(tokenizer)
        if what == "regex":
            if not isinstance(value, str) or not value:
                raise APIError(f"{param}: expected a regular expression string, got {kind(value)}", param=param,
                               code="invalid_type")
            return grammar.regex(value, tokenizer)
        if what == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
                raise APIError(f"{param}: expected a non-empty array of non-empty strings", param=param,
                               code="invalid_type")
            return grammar.choice(value, tokenizer)
        if what == "grammar":
            if not isinstance(value, str) or not value.strip():
                raise APIError(f"{param}: expected a Lark or GBNF grammar string, got {kind(value)}", param=param,
                               code="invalid_type")
            return grammar.lark(value, tokenizer)
    except grammar.GrammarError as e:
        raise APIError(f"{param}: {e}", param=param, code="invalid_grammar") from None
    raise AssertionError(what)


def requested(body: dict) -> tuple[str, Any, str] | None:
    """(kind, value, field) of the structured output the request asks for, or None.
    kind: json_schema | json_object | regex | choice | grammar."""
    found = []
    for field in _FIELDS:
        v = body.get(field)
        if v is None:
            continue
        spec = _one(field, v)
        if spec is not None:
            found.append(spec)
    if len(found) > 1:
        raise bad(found[1][2], f"only one kind of structured output per request; {found[0][2]} is given too")
    return found[0] if found else None


def _one(field: str, v: Any) -> tuple[str, Any, str] | None:
    if field == "response_format":
        if not isinstance(v, dict):
            raise bad(field, f"expected an object, got {kind(v)}", "invalid_type")
        t = v.get("type")
        if t == "text":
            return None
        if t == "json_object":
            return ("json_object", None, field)
        if t == "json_schema":
            spec = v.get("json_schema")
            if not isinstance(spec, dict):
                raise bad(f"{field}.json_schema", f"expected an object with a schema, got {kind(spec)}",
                          "invalid_type")
            if spec.get("name") is not None and not isinstance(spec["name"], str):
                raise bad(f"{field}.json_schema.name", f"expected a string, got {kind(spec['name'])}", "invalid_type")
            if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
                raise bad(f"{field}.json_schema.strict", f"expected a boolean, got {kind(spec['strict'])}",
                          "invalid_type")
            if spec.get("schema") is None:
                return ("json_object", None, field)
            return ("json_schema", spec["schema"], f"{field}.json_schema.schema")
        raise bad(f"{field}.type", f"expected text, json_object or json_schema, got {t!r}")
    if field == "structured_outputs":
        if not isinstance(v, dict):
            raise bad(field, f"expected an object, got {kind(v)}", "invalid_type")
        keys = [k for k in _STRUCTURED_KEYS if v.get(k) is not None and v.get(k) is not False]
        if len(keys) != 1:
            raise bad(field, f"expected exactly one of {', '.join(_STRUCTURED_KEYS)}, got "
                             f"{', '.join(keys) if keys else 'none'}")
        k = keys[0]
        if k == "json_object":
            return ("json_object", None, f"{field}.json_object")
        return ("json_schema" if k == "json" else k, v[k], f"{field}.{k}")
    return {"guided_json": ("json_schema", v, field), "guided_regex": ("regex", v, field),
            "guided_choice": ("choice", v, field), "guided_grammar": ("grammar", v, field),
            "json_schema": ("json_schema", v, field), "grammar": ("grammar", v, field)}[field]


def output_grammar(body: dict, tokenizer):
    """The grammar the request's structured-output fields ask for (both endpoints), or None."""
    spec = requested(body)
    if spec is None:
        return None
    what, value, param = spec
    return _compile(what, value, param, tokenizer)


def chat_grammar(body: dict, tokenizer, tools: list[dict] | None, choice: ToolChoice, parallel: bool):
    """A chat request's grammar: its tool calls (tool_choice required, a named function, or auto),
    its structured output, or both (auto with a JSON answer), or None."""
    from appliance.engine import grammar

    spec = requested(body)
    if not tools or choice.mode == "none":
        return None if spec is None else _compile(*spec, tokenizer)
    offered = [t for t in tools if choice.mode != "function" or t["function"]["name"] == choice.name]
    pairs = []
    for i, t in enumerate(tools):
        if t not in offered:
            continue
        params = t["function"].get("parameters") or EMPTY_PARAMETERS
        _compile("json_schema", params, f"tools[{i}].function.parameters", tokenizer)   # says which tool
        pairs.append((t["function"]["name"], params))
    answer = None
    if choice.mode == "auto" and spec is not None:
        if spec[0] not in ("json_schema", "json_object"):
            raise bad(spec[2], "with tools offered, only a JSON answer (json_object or json_schema) can be combined")
        answer = spec[1] if spec[0] == "json_schema" else {"type": "object"}
        if isinstance(answer, str):
            _compile(*spec, tokenizer)
            answer = json.loads(answer)
        _compile("json_schema", answer, spec[2], tokenizer)
    try:
        return grammar.tool_calls(pairs, "auto" if choice.mode == "auto" else "required",
                                  parallel, tokenizer, answer=answer)
    except grammar.GrammarError as e:
        raise APIError(f"tools: {e}", param="tools", code="invalid_grammar") from None
