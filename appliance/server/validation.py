"""Request bodies -> validated generation requests, or an APIError naming the parameter.

Every check answers 4xx with an OpenAI-shaped error; nothing malformed reaches the
scheduler. Sampling fields the request leaves out take the model's
generation_config.json defaults (as Qwen's model cards recommend), then OpenAI's.
Chat messages, tools and the template are chat.py's.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

from appliance.server import chat, structured
from appliance.server.chat import ToolChoice
from appliance.server import speculative_params
from appliance.server.errors import APIError
from appliance.server.json_body import read_json_body  # noqa: F401  (the endpoints' one reader)
from appliance.server.request_fields import (CHAT, COMPLETION, GENERATION, MAX_LOGIT_BIAS, MAX_STOP,
                                             MAX_STOP_TOKEN_IDS, get_bool)

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
    reasoning: str | None = None  # the reasoning parser's start state ("allowed", "open", "closed"); None: no split
    tools: list | None = None     # offered (and not hidden by tool_choice "none"): parse calls out of the answer
    tool_choice: ToolChoice = field(default_factory=lambda: ToolChoice("none"))
    parallel_tool_calls: bool = True


@dataclass
class ServingDefaults:
    """What the server's settings add to every request."""
    model_names: tuple[str, ...]                 # the names `model` may take; the first is reported
    chat_template_kwargs: dict = field(default_factory=dict)
    max_thinking_tokens: int | None = None
    reasoning_parser: str = "qwen3"
    speculative: Any = None                      # SpeculativeConfig of --spec-prompt-lookup, or None

    @classmethod
    def from_settings(cls, settings, engine) -> "ServingDefaults":
        names = [n.strip() for n in (getattr(settings, "served_model_name", None) or "").split(",") if n.strip()]
        return cls(model_names=tuple(names or [engine.model_name]),
                   chat_template_kwargs=chat.parse_json_object_setting(
                       getattr(settings, "chat_template_kwargs", None)),
                   max_thinking_tokens=getattr(settings, "max_thinking_tokens", None),
                   reasoning_parser=getattr(settings, "reasoning_parser", "qwen3") or "qwen3",
                   speculative=speculative_params.server_default(settings))


_kind, _bad = chat.kind, chat.bad


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


def check_model(body: dict, served) -> str:
    """The model a request names: one of the served names (a str or a sequence of them);
    the answer reports the name it was asked by, or the first."""
    names = (served,) if isinstance(served, str) else tuple(served)
    v = body.get("model", _MISSING)
    if v is _MISSING or v is None:
        return names[0]
    if not isinstance(v, str):
        raise _bad("model", f"expected a string, got {_kind(v)}", "invalid_type")
    if v not in names:
        raise APIError(f"the model {v!r} does not exist; this server serves {', '.join(map(repr, names))}", 404,
                       param="model", code="model_not_found")
    return v


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


def prompt_limit(engine) -> tuple[int, str]:
    """How many tokens a prompt and its answer can hold together, and what sets it. The
    context: the KV pool is never smaller (the engine refuses to load with one that is)."""
    return engine.max_context, f"the model's context is {engine.max_context} tokens"


def check_fits(n_prompt: int, engine, param: str) -> None:
    limit, what = prompt_limit(engine)
    if n_prompt + 1 > limit:
        raise APIError(f"the prompt is {n_prompt} tokens long but {what} "
                       f"(room is needed for at least one generated token)", param=param,
                       code="context_length_exceeded")
    if n_prompt == 0:
        raise APIError(f"{param}: the prompt is empty", param=param, code="invalid_value")


# Normalization (NFC composes, some strip accents) can shorten a text before it is split: the
# bound below allows for it, so only a text that cannot fit whatever it says is refused untokenized.
NORMALIZATION_SLACK = 4


def check_text_could_fit(n_chars: int, engine, param: str) -> None:
    """Refuse a prompt too long to fit before tokenizing it (a 50 MB prompt would hold the
    interpreter for seconds just to be refused): no token decodes to more characters than the
    vocabulary's longest, so the prompt has at least n_chars / longest tokens."""
    limit, what = prompt_limit(engine)
    longest = longest_token_chars(engine.tokenizer)
    at_least = n_chars // (longest * NORMALIZATION_SLACK)
    if at_least + 1 > limit:
        raise APIError(f"the prompt is {n_chars} characters long, at least {at_least} tokens, but {what}",
                       param=param, code="context_length_exceeded")


@functools.lru_cache(maxsize=4)
def longest_token_chars(tokenizer) -> int:
    """Characters of the vocabulary's longest token (byte-level tokens: one character per byte,
    at least as many as the text it decodes to)."""
    pieces = (tokenizer.id_to_token(i) for i in range(tokenizer.vocab_size))
    return max(1, max((len(p) for p in pieces if p), default=1))


def _vocab(engine) -> int:
    return int(engine.info().get("vocab") or 0)


def get_logit_bias(body: dict, vocab: int) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]} (JSON keys are strings)."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise _bad("logit_bias", f"expected an object mapping token ids to numbers, got {_kind(v)}", "invalid_type")
    if len(v) > MAX_LOGIT_BIAS:
        raise _bad("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(v)}")
    out = {}
    for key, bias in v.items():
        try:
            token = int(key)
        except ValueError:
            raise _bad("logit_bias", f"keys are token ids, got {key!r}") from None
        if token < 0 or (vocab and token >= vocab):
            raise _bad("logit_bias", f"token id {token} is outside the vocabulary [0, {vocab})")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            raise _bad("logit_bias", f"the bias of token {token} must be a number, got {_kind(bias)}",
                       "invalid_type")
        if not -100 <= bias <= 100:
            raise _bad("logit_bias", f"the bias of token {token} ({bias:g}) is out of range [-100, 100]")
        out[token] = float(bias)
    return out or None


def get_token_ids(body: dict, name: str, vocab: int, limit: int) -> tuple[int, ...]:
    v = body.get(name)
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        raise _bad(name, "expected an array of integer token ids", "invalid_type")
    if len(v) > limit:
        raise _bad(name, f"at most {limit} token ids, got {len(v)}")
    bad = [t for t in v if t < 0 or (vocab and t >= vocab)]
    if bad:
        raise _bad(name, f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
    return tuple(v)


def sampling_params(body: dict, engine, n_prompt: int, logprobs: int | None,
                    default_max_tokens: int | None = None, **engine_side):
    """Build SamplingParams from the common fields (both endpoints). max_tokens beyond
    the room left in the context is clamped: the answer then ends with "length".
    engine_side: fields the endpoint decided itself (thinking, max_thinking_tokens)."""
    from appliance.engine.sampling import SamplingParams

    defaults = dict(engine.generation_defaults or {})
    room = prompt_limit(engine)[0] - n_prompt
    f = GENERATION
    max_tokens = f["max_completion_tokens"].read(body, f["max_tokens"].read(body))
    f["n"].read(body)
    f["best_of"].read(body)
    top_k = f["top_k"].read(body, defaults.get("top_k", 0))
    seed = f["seed"].read(body)
    if seed is not None and seed < 0:
        seed = None                                   # some clients send -1 for "random"
    vocab = _vocab(engine)
    max_tokens = min(max_tokens or default_max_tokens or room, room)
    min_tokens = f["min_tokens"].read(body, 0)
    if min_tokens > max_tokens:
        if "max_tokens" in body or "max_completion_tokens" in body:
            raise _bad("min_tokens", f"{min_tokens} is more than max_tokens ({max_tokens})")
        min_tokens = max_tokens                   # the context has less room than asked for
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=f["temperature"].read(body, defaults.get("temperature", 1.0)),
        top_p=f["top_p"].read(body, defaults.get("top_p", 1.0)),
        top_k=max(0, top_k),
        min_p=f["min_p"].read(body, defaults.get("min_p", 0.0)),
        repetition_penalty=f["repetition_penalty"].read(body, defaults.get("repetition_penalty", 1.0)),
        presence_penalty=f["presence_penalty"].read(body, 0.0),
        frequency_penalty=f["frequency_penalty"].read(body, 0.0),
        logit_bias=get_logit_bias(body, vocab),
        min_tokens=min_tokens,
        stop_token_ids=get_token_ids(body, "stop_token_ids", vocab, MAX_STOP_TOKEN_IDS),
        seed=seed,
        stop=list(get_stop(body)),
        logprobs=logprobs,
        ignore_eos=f["ignore_eos"].read(body, False),
        **engine_side,
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


def parse_chat(body: dict, engine, image_policy=None, serving: ServingDefaults | None = None) -> GenerationRequest:
    serving = serving or ServingDefaults((engine.model_name,))
    model = check_model(body, serving.model_names)
    image_refs: list[tuple[str, str]] = []
    messages = chat.parse_messages(body, image_refs)
    stream = CHAT["stream"].read(body, False)
    include_usage = stream_options(body, stream)
    want_logprobs = CHAT["logprobs"].read(body, False)
    top = CHAT["top_logprobs"].read(body)
    if top is not None and not want_logprobs:
        raise _bad("top_logprobs", "requires logprobs to be true")
    tools = chat.parse_tools(body)
    choice = chat.parse_tool_choice(body, tools)
    parallel = CHAT["parallel_tool_calls"].read(body, True)
    offered = tools if tools and choice.mode != "none" else None      # "none" hides the tools
    grammar = structured.chat_grammar(body, engine.tokenizer, offered, choice, parallel)
    kwargs = chat.template_kwargs(body, serving.chat_template_kwargs)
    images = prepare_images(image_refs, engine, image_policy)
    text = chat.render(engine, messages, offered, kwargs)
    check_text_could_fit(len(text), engine, "messages")
    prompt_ids = engine.tokenizer.encode(text)
    if images:
        try:
            prompt_ids = engine.expand_image_tokens(prompt_ids, images)
        except ValueError as e:          # the template dropped or repeated image placeholders
            raise APIError(f"messages: {e}", param="messages", code="invalid_messages") from None
    check_fits(len(prompt_ids), engine, "messages")
    thinking = chat.thought_state(engine, messages, offered, kwargs, text)
    budget = CHAT["max_thinking_tokens"].read(body)
    if budget is not None and engine.tokenizer.think_token_ids is None:
        raise _bad("max_thinking_tokens", f"the model {engine.model_name!r} does not think in <think> tags")
    if budget is None:
        budget = serving.max_thinking_tokens
    params = sampling_params(body, engine, len(prompt_ids), (top or 0) if want_logprobs else None,
                             thinking=thinking, max_thinking_tokens=budget if thinking else None,
                             grammar=grammar)
    params.logit_bias = chat.without_calls(engine.tokenizer, offered, params.logit_bias)
    params.speculative = speculative_params.parse(body, serving)
    return GenerationRequest("chat", model, prompt_ids, params, stream, include_usage,
                             want_logprobs, top or 0, images or None,
                             reasoning=_reasoning_state(engine, serving, thinking),
                             tools=offered, tool_choice=choice, parallel_tool_calls=parallel)


def _reasoning_state(engine, serving: ServingDefaults, thinking: str | None) -> str | None:
    """The reasoning parser's start state; None: the reply is not split (no thought tags, or
    --reasoning-parser none)."""
    if serving.reasoning_parser == "none" or engine.tokenizer.think_token_ids is None:
        return None
    return thinking or "closed"


def completion_prompt(body: dict, engine) -> list[int]:
    p = body.get("prompt", _MISSING)
    if p is _MISSING or p is None:
        raise APIError("prompt: required", param="prompt", code="missing_required_parameter")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]                                  # a batch of one
    if isinstance(p, str):
        if not p:
            raise _bad("prompt", "must not be empty")
        check_text_could_fit(len(p), engine, "prompt")
        return engine.tokenizer.encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        vocab = _vocab(engine)
        bad = [t for t in p if t < 0 or (vocab and t >= vocab)]
        if bad:
            raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary [0, {vocab})")
        return list(p)
    if isinstance(p, list) and len(p) > 1 and all(isinstance(t, (str, list)) for t in p):
        raise _bad("prompt", "only one prompt per request is supported")
    raise _bad("prompt", f"expected a string or an array of token ids, got {_kind(p)}", "invalid_type")


def parse_completion(body: dict, engine, serving: ServingDefaults | None = None) -> GenerationRequest:
    model = check_model(body, serving.model_names if serving else engine.model_name)
    prompt_ids = completion_prompt(body, engine)
    stream = COMPLETION["stream"].read(body, False)
    include_usage = stream_options(body, stream)
    if get_bool(body, "echo", False):
        raise _bad("echo", "echo is not supported")
    if body.get("suffix") is not None:
        raise _bad("suffix", "suffix is not supported")
    top = COMPLETION["logprobs"].read(body)
    check_fits(len(prompt_ids), engine, "prompt")
    params = sampling_params(body, engine, len(prompt_ids), top, default_max_tokens=16,
                             grammar=structured.output_grammar(body, engine.tokenizer))
    params.speculative = speculative_params.parse(body, serving)
    return GenerationRequest("completion", model, prompt_ids, params, stream, include_usage,
                             top is not None, top or 0)
