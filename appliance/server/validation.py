"""Request bodies -> validated generation requests, or an APIError naming the parameter.

Every check answers 4xx with an OpenAI-shaped error; nothing malformed reaches the
scheduler. Sampling fields the request leaves out take the model's
generation_config.json defaults (as Qwen's model cards recommend), then OpenAI's.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from flask import request

from appliance.server.errors import APIError

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 4
MAX_TOP_LOGPROBS_CHAT = 20
MAX_LOGPROBS_COMPLETION = 5
MAX_IMAGES = 8                   # image parts per chat request
_MISSING = object()


@dataclass
class GenerationRequest:
    kind: str                    # "chat" | "completion"
    model: str
    prompt_ids: list[int]
    params: Any                  # appliance.sampling.SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool               # return logprobs at all
    top_logprobs: int            # alternatives per token
    images: list | None = None   # prepared images (appliance.images.ImageInput); prompt_ids already expanded


def read_json_body() -> dict:
    """The body as a JSON object (any Content-Type: curl -d sends form encoding)."""
    raw = request.get_data(cache=True)       # 413 past MAX_CONTENT_LENGTH
    if not raw.strip():
        raise APIError("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw, parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise APIError("the request body is not UTF-8", code="invalid_json") from None
    except ValueError as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body must be a JSON object, not {_kind(body)}", code="invalid_json")
    return body


def _reject_constant(name: str):
    raise ValueError(f"{name} is not allowed")


def _kind(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "an array", dict: "an object"}.get(type(value), type(value).__name__)


def _bad(param: str, message: str, code: str = "invalid_value") -> APIError:
    return APIError(f"{param}: {message}", param=param, code=code)


def get_bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if not isinstance(v, bool):
        raise _bad(name, f"expected a boolean, got {_kind(v)}", "invalid_type")
    return v


def get_int(body: dict, name: str, lo: int | None, hi: int | None, default: Any = None) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise _bad(name, f"expected an integer, got {_kind(v)}", "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise _bad(name, f"{v} is out of range [{'' if lo is None else lo}, {'' if hi is None else hi}]")
    return v


def get_float(body: dict, name: str, lo: float, hi: float, default: Any = None,
              lo_open: bool = False) -> Any:
    v = body.get(name, _MISSING)
    if v is _MISSING or v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _bad(name, f"expected a number, got {_kind(v)}", "invalid_type")
    v = float(v)
    if not math.isfinite(v) or v > hi or v < lo or (lo_open and v == lo):
        left = "(" if lo_open else "["
        raise _bad(name, f"{v:g} is out of range {left}{lo:g}, {hi:g}]")
    return v


def get_stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list):
        raise _bad("stop", f"expected a string or an array of strings, got {_kind(v)}", "invalid_type")
    if len(v) > MAX_STOP:
        raise _bad("stop", f"at most {MAX_STOP} stop sequences, got {len(v)}")
    for s in v:
        if not isinstance(s, str):
            raise _bad("stop", f"stop sequences must be strings, got {_kind(s)}", "invalid_type")
        if not s:
            raise _bad("stop", "stop sequences must not be empty")
    return tuple(v)


def check_model(body: dict, served: str) -> str:
    v = body.get("model", _MISSING)
    if v is _MISSING or v is None:
        return served
    if not isinstance(v, str):
        raise _bad("model", f"expected a string, got {_kind(v)}", "invalid_type")
    if v != served:
        raise APIError(f"the model {v!r} does not exist; this server serves {served!r}", 404,
                       param="model", code="model_not_found")
    return v


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
                raise _bad(f"{param}[{j}]", f"expected an object, got {_kind(part)}", "invalid_type")
            if part.get("type") == "image_url" and images is not None:
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise _bad(f"{param}[{j}].image_url.url", f"expected a data: URL string, got {_kind(url)}",
                               "invalid_type")
                images.append((f"{param}[{j}].image_url", url))
                rendered.append({"type": "image"})
                continue
            if part.get("type") != "text":
                raise _bad(f"{param}[{j}].type", f"only 'text' parts are supported, got {part.get('type')!r}")
            if not isinstance(part.get("text"), str):
                raise _bad(f"{param}[{j}].text", f"expected a string, got {_kind(part.get('text'))}",
                           "invalid_type")
            parts.append(part["text"])
            rendered.append({"type": "text", "text": part["text"]})
        return "".join(parts) if len(rendered) == len(parts) else rendered
    raise _bad(param, f"expected a string or an array of text parts, got {_kind(content)}", "invalid_type")


def parse_messages(body: dict, images: list | None = None) -> list[dict]:
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise APIError("messages: a list of messages is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list):
        raise _bad("messages", f"expected an array, got {_kind(messages)}", "invalid_type")
    if not messages:
        raise _bad("messages", "must contain at least one message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise _bad(f"messages[{i}]", f"expected an object, got {_kind(m)}", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str) or role not in ROLES:
            raise _bad(f"messages[{i}].role", f"expected one of {', '.join(ROLES)}, got {role!r}")
        if "content" not in m or m["content"] is None:
            raise APIError(f"messages[{i}].content: required", param=f"messages[{i}].content",
                           code="missing_required_parameter")
        out.append({"role": "system" if role == "developer" else role,
                    "content": message_text(m["content"], i, images)})
    return out


def image_policy(settings):
    """Where image_url may point: data: URLs, plus http(s) hosts in settings.image_url_hosts."""
    from appliance.server.image_fetch import ImageFetchPolicy

    hosts = [h.strip() for h in (getattr(settings, "image_url_hosts", None) or "").split(",") if h.strip()]
    return ImageFetchPolicy(allowed_hosts=hosts)


def prepare_images(refs: list[tuple[str, str]], engine, policy) -> list:
    """image_url parts -> prepared images; every problem is a 400 naming the part."""
    from appliance.models.images import ImageError
    from appliance.server.image_fetch import image_bytes_from_url

    if not refs:
        return []
    if not getattr(engine, "supports_images", False):
        raise _bad(refs[0][0], f"the model {engine.model_name!r} does not take images", "unsupported_content")
    if len(refs) > MAX_IMAGES:
        raise _bad(refs[MAX_IMAGES][0], f"at most {MAX_IMAGES} images per request, got {len(refs)}")
    out = []
    for param, url in refs:
        try:
            out.append(engine.prepare_image(image_bytes_from_url(url, policy)))
        except ImageError as e:
            raise APIError(f"{param}: {e}", param=param, code="invalid_image") from None
    return out


def render_chat(engine, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The model's own chat template; a template that refuses the messages is a 400."""
    try:
        return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    except ValueError as e:
        raise APIError(f"messages: {e}", param="messages", code="invalid_messages") from None


def check_fits(n_prompt: int, max_context: int, param: str) -> None:
    if n_prompt + 1 > max_context:
        raise APIError(f"the prompt is {n_prompt} tokens long but the model's context is {max_context} tokens "
                       f"(room is needed for at least one generated token)", param=param,
                       code="context_length_exceeded")
    if n_prompt == 0:
        raise APIError(f"{param}: the prompt is empty", param=param, code="invalid_value")


def sampling_params(body: dict, engine, n_prompt: int, logprobs: int | None,
                    default_max_tokens: int | None = None):
    """Build SamplingParams from the common fields (both endpoints). max_tokens beyond
    the room left in the context is clamped: the answer then ends with "length"."""
    from appliance.engine.sampling import SamplingParams

    defaults = dict(engine.generation_defaults or {})
    room = engine.max_context - n_prompt
    max_tokens = get_int(body, "max_tokens", 1, None)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = get_int(body, "max_completion_tokens", 1, None)
    n = get_int(body, "n", 1, None, 1)
    if n != 1:
        raise _bad("n", f"only n=1 is supported, got {n}")
    best_of = get_int(body, "best_of", 1, None, 1)
    if best_of != 1:
        raise _bad("best_of", f"only best_of=1 is supported, got {best_of}")
    # accepted for compatibility and range-checked; this engine applies repetition_penalty instead
    get_float(body, "presence_penalty", -2.0, 2.0)
    get_float(body, "frequency_penalty", -2.0, 2.0)
    top_k = get_int(body, "top_k", -1, None, defaults.get("top_k", 0))
    seed = get_int(body, "seed", -(2 ** 63), 2 ** 64 - 1)
    if seed is not None and seed < 0:
        seed = None                                   # some clients send -1 for "random"
    return SamplingParams(
        max_tokens=min(max_tokens or default_max_tokens or room, room),
        temperature=get_float(body, "temperature", 0.0, 2.0, defaults.get("temperature", 1.0)),
        top_p=get_float(body, "top_p", 0.0, 1.0, defaults.get("top_p", 1.0), lo_open=True),
        top_k=max(0, top_k),
        min_p=get_float(body, "min_p", 0.0, 1.0, defaults.get("min_p", 0.0)),
        repetition_penalty=get_float(body, "repetition_penalty", 0.0, 10.0,
                                     defaults.get("repetition_penalty", 1.0), lo_open=True),
        seed=seed,
        stop=list(get_stop(body)),
        logprobs=logprobs,
        ignore_eos=get_bool(body, "ignore_eos", False),
    )


def stream_options(body: dict, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise _bad("stream_options", f"expected an object, got {_kind(opts)}", "invalid_type")
    if not stream:
        raise _bad("stream_options", "only allowed when stream is true")
    return get_bool(opts, "include_usage", False)


def parse_chat(body: dict, engine, image_policy=None) -> GenerationRequest:
    model = check_model(body, engine.model_name)
    image_refs: list[tuple[str, str]] = []
    messages = parse_messages(body, image_refs)
    stream = get_bool(body, "stream", False)
    include_usage = stream_options(body, stream)
    want_logprobs = get_bool(body, "logprobs", False)
    top = get_int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS_CHAT)
    if top is not None and not want_logprobs:
        raise _bad("top_logprobs", "requires logprobs to be true")
    rf = body.get("response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise _bad("response_format", "only {\"type\": \"text\"} is supported")
    if body.get("tools"):
        raise _bad("tools", "tool calling is not supported by this server")
    images = prepare_images(image_refs, engine, image_policy)
    text = render_chat(engine, messages)
    prompt_ids = engine.tokenizer.encode(text)
    if images:
        try:
            prompt_ids = engine.expand_image_tokens(prompt_ids, images)
        except ValueError as e:          # the template dropped or repeated image placeholders
            raise APIError(f"messages: {e}", param="messages", code="invalid_messages") from None
    check_fits(len(prompt_ids), engine.max_context, "messages")
    params = sampling_params(body, engine, len(prompt_ids), (top or 0) if want_logprobs else None)
    return GenerationRequest("chat", model, prompt_ids, params, stream, include_usage,
                             want_logprobs, top or 0, images or None)


def completion_prompt(body: dict, engine) -> list[int]:
    p = body.get("prompt", _MISSING)
    if p is _MISSING or p is None:
        raise APIError("prompt: required", param="prompt", code="missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                                  # a batch of one
    if isinstance(p, str):
        if not p:
            raise _bad("prompt", "must not be empty")
        return engine.tokenizer.encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        vocab = int(engine.info().get("vocab") or 0)
        bad = [t for t in p if t < 0 or (vocab and t >= vocab)]
        if bad:
            raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise _bad("prompt", "only one prompt per request is supported")
    raise _bad("prompt", f"expected a string or an array of token ids, got {_kind(p)}", "invalid_type")


def parse_completion(body: dict, engine) -> GenerationRequest:
    model = check_model(body, engine.model_name)
    prompt_ids = completion_prompt(body, engine)
    stream = get_bool(body, "stream", False)
    include_usage = stream_options(body, stream)
    if get_bool(body, "echo", False):
        raise _bad("echo", "echo is not supported")
    if body.get("suffix") is not None:
        raise _bad("suffix", "suffix is not supported")
    top = get_int(body, "logprobs", 0, MAX_LOGPROBS_COMPLETION)
    check_fits(len(prompt_ids), engine.max_context, "prompt")
    params = sampling_params(body, engine, len(prompt_ids), top, default_max_tokens=16)
    return GenerationRequest("completion", model, prompt_ids, params, stream, include_usage,
                             top is not None, top or 0)
