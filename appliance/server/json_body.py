"""A request body -> a JSON object, or a 4xx naming what is wrong with it.

Hostile bodies are refused here, before any field is looked at, so that nothing downstream
(the tokenizer, the chat template, the grammar engine, numpy) meets a value it would fail on:

    a media type that is not JSON          415 (curl -d's form encoding and text/plain pass:
                                           clients send JSON under them)
    bytes that are not UTF-8               400 naming the byte
    NaN, Infinity, 1e400, 10**30           400: numbers must be finite, integers fit 64 bits
    "\\ud800" (a lone surrogate)            400 naming the field: it cannot be encoded
    [[[[...]]]] nested past MAX_DEPTH      400: deep nesting would exhaust a recursive reader
    a top level that is not an object      400
"""
from __future__ import annotations

import json
import re

from flask import request

from appliance.server.chat import kind as _kind
from appliance.server.errors import APIError

MAX_DEPTH = 128                   # containers inside containers; a 40-level JSON schema is far below
MIN_INT, MAX_INT = -(2 ** 63), 2 ** 64 - 1      # seeds are uint64; token ids, counts far smaller
JSON_MEDIA_TYPES = ("application/json", "application/x-www-form-urlencoded", "text/plain")
UTF8_CHARSETS = ("utf-8", "utf8", "us-ascii", "ascii")
# \uD800-\uDFFF escapes: only then can a parsed string hold a surrogate (paired ones decode to
# one character, so the strings themselves are checked)
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def read_json_body() -> dict:
    """The request's body as a JSON object."""
    _check_media_type(request.mimetype, request.mimetype_params)
    raw = request.get_data(cache=True)       # 413 past MAX_CONTENT_LENGTH
    return parse_json_object(raw)


def parse_json_object(raw: bytes) -> dict:
    if not raw.strip():
        raise APIError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise APIError(f"the request body is not UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})",
                       code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=_reject_constant, parse_float=_finite_float, parse_int=_bounded_int)
    except RecursionError:
        raise APIError(f"the request body is nested too deeply (more than {MAX_DEPTH} levels)",
                       code="invalid_json") from None
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {_kind(body)}", code="invalid_json")
    surrogates = _SURROGATE_ESCAPE.search(text) is not None
    if surrogates or text.count("[") + text.count("{") > MAX_DEPTH:      # else neither can be present
        _check_tree(body, surrogates)
    return body


def _check_media_type(mimetype: str, params: dict) -> None:
    if mimetype and mimetype not in JSON_MEDIA_TYPES and not mimetype.endswith("+json"):
        raise APIError(f"Content-Type {mimetype!r} is not supported; send application/json", 415,
                       code="unsupported_media_type")
    charset = (params.get("charset") or "utf-8").lower()
    if charset not in UTF8_CHARSETS:
        raise APIError(f"charset {charset!r} is not supported; send the JSON body as UTF-8", 415,
                       code="unsupported_media_type")


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise APIError(f"the number {_short(text)} is out of range (numbers must be finite 64-bit floats)",
                       code="invalid_json")
    return value


def _bounded_int(text: str) -> int:
    value = int(text) if len(text) <= 24 else None
    if value is None or not MIN_INT <= value <= MAX_INT:
        raise APIError(f"the integer {_short(text)} is out of range [-2^63, 2^64 - 1]", code="invalid_json")
    return value


def _short(text: str) -> str:
    return text if len(text) <= 24 else f"{text[:12]}...({len(text)} digits)"


def _check_tree(body: dict, surrogates: bool) -> None:
    """Depth and lone surrogates, without recursion: the body may be nested MAX_DEPTH deep."""
    stack = [(body, "", 1)]
    while stack:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            top = path[:path.find("[", 1) if "[" in path[1:] else len(path)] or path[:40]
            raise APIError(f"{top}: nested more than {MAX_DEPTH} levels deep", param=top, code="invalid_json")
        for key, value in (node.items() if type(node) is dict else enumerate(node)):
            if surrogates and type(key) is str:
                _check_string(key, f"a key of {path or 'the body'}", path or None)
            kind = type(value)
            if kind is dict or kind is list:
                stack.append((value, _join(path, key), depth + 1))
            elif surrogates and kind is str:
                _check_string(value, _join(path, key))


def _check_string(value: str, where: str, param: str | None = "") -> None:
    m = _SURROGATE.search(value)
    if m is not None:
        raise APIError(f"{where}: contains a lone surrogate (\\u{ord(m.group()):04x} at character {m.start()}), "
                       f"which is not valid Unicode", param=where if param == "" else param, code="invalid_value")


def _join(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)
