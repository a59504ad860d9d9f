"""Chat requests as clients send them -> what the model's own chat template renders.

Messages keep what the template reads: assistant turns their `tool_calls` and
`reasoning_content` (content may be null beside tool calls), tool results their
`tool_call_id` and `name`. `tools` and `tool_choice` are OpenAI's; `chat_template_kwargs`
(vLLM's) reach the template as keyword arguments, over the server's defaults, so
`{"enable_thinking": false}` switches Qwen3's thinking off. Every problem is a 400 naming
the field.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from appliance.server import tool_calls
from appliance.server.errors import APIError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")        # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")
# Names the renderer passes itself: a chat_template_kwargs key may not replace them.
RESERVED_TEMPLATE_KEYS = ("messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token")
_MISSING = object()


def kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(f"{param}: {message}", param=param, code=code)


# ---- messages ---------------------------------------------------------------------------------

def message_text(content: Any, index: int, images: list | None = None) -> str | list:
    """A message's content as text: a string, or an array of text parts. With `images` (a list
    collecting (param, url) of image_url parts), image parts are allowed: the content is then
    the parts for the chat template, an image as {"type": "image"}."""
    param = f"messages[{index}].content"
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts, rendered = [], []
        for j, part in enumerate(content):
            if not isinstance(part, dict):
                raise bad(f"{param}[{j}]", f"expected an object, got {kind(part)}", "invalid_type")
            if part.get("type") == "image_url" and images is not None:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise bad(f"{param}[{j}].image_url.url", f"expected a data: URL string, got {kind(url)}",
                              "invalid_type")
                images.append((f"{param}[{j}].image_url", url))
                rendered.append({"type": "image"})
                continue
            if part.get("type") != "text":
                raise bad(f"{param}[{j}].type", f"only 'text' parts are supported, got {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise bad(f"{param}[{j}].text", f"expected a string, got {kind(part.get('text'))}", "invalid_type")
            parts.append(part["text"])
            rendered.append({"type": "text", "text": part["text"]})
        return "".join(parts) if len(rendered) == len(parts) else rendered
    raise bad(param, f"expected a string or an array of text parts, got {kind(content)}", "invalid_type")


def _optional_string(m: dict, key: str, param: str) -> str | None:
    v = m.get(key)
    if v is not None and not isinstance(v, str):
        raise bad(f"{param}.{key}", f"expected a string, got {kind(v)}", "invalid_type")
    return v


def _history_tool_calls(calls: Any, param: str) -> list[dict]:
    """An assistant turn's tool_calls, as the template reads them (arguments as sent)."""
    if not isinstance(calls, list):
        raise bad(param, f"expected an array, got {kind(calls)}", "invalid_type")
    out = []
    for j, call in enumerate(calls):
        p = f"{param}[{j}]"
        if not isinstance(call, dict):
            raise bad(p, f"expected an object, got {kind(call)}", "invalid_type")
        if call.get("type", "function") != "function":
            raise bad(f"{p}.type", f"only 'function' tool calls are supported, got {call.get('type')!r}")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{p}.function", f"expected an object, got {kind(fn)}", "invalid_type")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f"{p}.function.name", f"expected a function name, got {kind(fn.get('name'))}", "invalid_type")
        args = fn.get("arguments", "{}")
        if not isinstance(args, (str, dict)):
            raise bad(f"{p}.function.arguments", f"expected a JSON string, got {kind(args)}", "invalid_type")
        entry = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if call.get("id") is not None:
            entry["id"] = _optional_string(call, "id", p)
        out.append(entry)
    return out


def parse_messages(body: dict, images: list | None = None) -> list[dict]:
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise APIError("messages: a list of messages is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise bad("messages", f"expected an array, got {kind(messages)}", "invalid_type")
    if not messages:
        raise bad("messages", "must contain at least one message")
    return [_message(m, i, images) for i, m in enumerate(messages)]


def _message(m: Any, i: int, images: list | None) -> dict:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad(param, f"expected an object, got {kind(m)}", "invalid_type")
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise bad(f"{param}.role", f"expected one of {', '.join(ROLES)}, got {role!r}")
    out: dict = {"role": "system" if role == "developer" else role}
    content = m.get("content")
    if role == "assistant":
        # content may be null (or absent) beside tool calls; the template reads a string
        out["content"] = "" if content is None else message_text(content, i)
        if isinstance(out["content"], list):
            raise bad(f"{param}.content", "assistant content must be text", "invalid_type")
        if m.get("tool_calls") is not None:
            out["tool_calls"] = _history_tool_calls(m["tool_calls"], f"{param}.tool_calls")
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise bad(f"{param}.reasoning_content", f"expected a string, got {kind(reasoning)}", "invalid_type")
            out["reasoning_content"] = reasoning
    else:
        if content is None:
            raise APIError(f"{param}.content: required", param=f"{param}.content", code="missing_required_parameter")
        out["content"] = message_text(content, i, images if role == "user" else None)
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise APIError(f"{param}.tool_call_id: required for a tool message (the id of the call it answers)",
                           param=f"{param}.tool_call_id", code="missing_required_parameter")
        out["tool_call_id"] = call_id
    name = _optional_string(m, "name", param)
    if name is not None:
        out["name"] = name
    return out


# ---- tools -------------------------------------------------------------------------------------

def parse_tools(body: dict) -> list[dict] | None:
    """`tools` as the template renders them: [{"type": "function", "function": {...}}]."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad("tools", f"expected an array, got {kind(tools)}", "invalid_type")
    if len(tools) > MAX_TOOLS:
        raise bad("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    out, names = [], set()
    for i, tool in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise bad(p, f"expected an object, got {kind(tool)}", "invalid_type")
        if tool.get("type") != "function":
            raise bad(f"{p}.type", f"only 'function' tools are supported, got {tool.get('type')!r}")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad(f"{p}.function", f"expected an object, got {kind(fn)}", "invalid_type")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad(f"{p}.function.name", f"expected 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in names:
            raise bad(f"{p}.function.name", f"{name!r} is declared twice")
        names.add(name)
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad(f"{p}.function.description", f"expected a string, got {kind(fn['description'])}",
                      "invalid_type")
        params = fn.get("parameters")
        if params is not None:
            _check_parameters(params, f"{p}.function.parameters")
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise bad(f"{p}.function.strict", f"expected a boolean, got {kind(fn['strict'])}", "invalid_type")
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def _check_parameters(schema: Any, param: str) -> None:
    """A function's parameters: a JSON Schema describing an object (what OpenAI accepts)."""
    if not isinstance(schema, dict):
        raise bad(param, f"expected a JSON Schema object, got {kind(schema)}", "invalid_type")
    if schema.get("type", "object") != "object":
        raise bad(param, f"the parameters schema must describe an object (\"type\": \"object\"), "
                         f"got type {schema.get('type')!r}")
    props = schema.get("properties", {})
    if not isinstance(props, dict) or not all(isinstance(v, (dict, bool)) for v in props.values()):
        raise bad(f"{param}.properties", "expected an object of JSON Schemas")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise bad(f"{param}.required", "expected an array of property names")


@dataclass
class ToolChoice:
    mode: str                     # "none" | "auto" | "required" | "function"
    name: str | None = None       # the function, for mode "function"


def parse_tool_choice(body: dict, tools: list[dict] | None) -> ToolChoice:
    v = body.get("tool_choice")
    if v is None:
        return ToolChoice("auto" if tools else "none")
    if not tools:
        raise bad("tool_choice", "only allowed when tools are given")
    if isinstance(v, str):
        if v not in TOOL_CHOICES:
            raise bad("tool_choice", f"expected one of {', '.join(TOOL_CHOICES)} or a function, got {v!r}")
        return ToolChoice(v)
    if not isinstance(v, dict):
        raise bad("tool_choice", f"expected a string or an object, got {kind(v)}", "invalid_type")
    fn = v.get("function")
    if v.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad("tool_choice", 'expected {"type": "function", "function": {"name": ...}}')
    names = [t["function"]["name"] for t in tools]
    if fn["name"] not in names:
        raise bad("tool_choice", f"the function {fn['name']!r} is not among the tools ({', '.join(names)})")
    return ToolChoice("function", fn["name"])


def without_calls(tokenizer, offered: list[dict] | None, logit_bias: dict[int, float] | None):
    """The request's logit_bias, with the tag that opens a tool call banned when no tool is
    offered (none given, or tool_choice "none"). A started call is held to the offered
    functions (structured.chat_grammar); with none offered no call can be right, and a model's
    stray `<tool_call>` would reach the client as text. A bias the request sets on the tag wins."""
    tag = tokenizer.token_to_id(tool_calls.START)
    if offered or tag is None or (logit_bias and tag in logit_bias):
        return logit_bias
    return {**(logit_bias or {}), tag: -100.0}


# ---- the template ------------------------------------------------------------------------------

def template_kwargs(body: dict, defaults: dict | None) -> dict:
    """The server's chat_template_kwargs, then the request's over them."""
    out = dict(defaults or {})
    v = body.get("chat_template_kwargs")
    if v is None:
        return out
    if not isinstance(v, dict):
        raise bad("chat_template_kwargs", f"expected an object, got {kind(v)}", "invalid_type")
    for key in v:
        if key in RESERVED_TEMPLATE_KEYS:
            raise bad(f"chat_template_kwargs.{key}", f"{key!r} is set by the server, not by template arguments")
    out.update(v)
    return out


def render(engine, messages: list[dict], tools: list[dict] | None = None, kwargs: dict | None = None,
           add_generation_prompt: bool = True) -> str:
    """The model's own chat template; a template that refuses the messages is a 400."""
    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                    tools=tools, **(kwargs or {}))
    except ValueError as e:
        raise APIError(f"messages: {e}", param="messages", code="invalid_messages") from None


def thought_state(engine, messages: list[dict], tools, kwargs, prompt: str) -> str | None:
    """Where the reply starts with respect to a thought, read off what the template's generation
    prompt adds: "open" (it opened one), None (it closed one: thinking is off, or the model has
    no thought tags), "allowed" (the model may open one)."""
    if engine.tokenizer.think_token_ids is None:
        return None
    base = render(engine, messages, tools, kwargs, add_generation_prompt=False)
    suffix = prompt[len(base):] if prompt.startswith(base) else prompt
    opened, closed = suffix.rfind("<think>"), suffix.rfind("</think>")
    if opened > closed:
        return "open"
    return None if closed >= 0 else "allowed"


def parse_json_object_setting(text: str | None) -> dict:
    """A JSON object setting (chat_template_kwargs); config.validate has checked it parses."""
    return json.loads(text) if text else {}
