"""OpenAI-compatible API: /v1/chat/completions, /v1/completions, /v1/models,
plus /tokenize and /detokenize.

HTTP threads validate, tokenize and submit to the scheduler, then relay the
request's events: as server-sent events ending in `data: [DONE]` when streaming,
as one JSON body otherwise. A client that goes away is noticed between tokens
(the socket reads EOF, or a write fails) and its request is cancelled.
"""
from __future__ import annotations

import json
import logging
import select
import threading
import time

from flask import Blueprint, Response, current_app, jsonify, request

from appliance.server import chat
from appliance.server.access_log import CLIENT_KEY, USAGE_KEY
from appliance.server.reply import Reply
from appliance.server.scheduler import Finished, QueueFullError, ShuttingDownError
from appliance.server.errors import APIError
from appliance.server.validation import (GenerationRequest, ServingDefaults, check_model, get_bool, image_policy,
                                         parse_chat, parse_completion, read_json_body)

bp = Blueprint("openai", __name__)
log = logging.getLogger("appliance.server")

POLL_S = 0.25          # how often a waiting HTTP thread checks that its client is still there
KEEPALIVE_S = 15.0     # an SSE comment after this long without a token keeps proxies from timing out
SESSION_HEADER = "X-Session-Id"
MAX_SESSION_CHARS = 128


def runtime():
    return current_app.extensions["appliance"]


def serving(rt) -> ServingDefaults:
    """What the settings add to every request, built once per loaded engine."""
    held = current_app.extensions.get("appliance_serving")
    if held is None or held[0] is not rt.engine:
        held = current_app.extensions["appliance_serving"] = (rt.engine, ServingDefaults.from_settings(rt.settings,
                                                                                                        rt.engine))
        # the grammar engine's view of the vocabulary (about a second for Qwen's 150K tokens),
        # built now rather than on the first structured-output request
        threading.Thread(target=_warm_grammar_bridge, args=(rt.engine.tokenizer,), name="grammar-bridge",
                         daemon=True).start()
    return held[1]


def _warm_grammar_bridge(tokenizer) -> None:
    from appliance.engine import grammar
    try:
        grammar.bridge(tokenizer)
    except Exception as e:              # structured output then answers with the reason, per request
        log.warning("the grammar engine's token bridge could not be built: %s", e)


@bp.before_request
def _authorize_and_check_ready():
    rt = runtime()
    keys = current_app.extensions["appliance_api_keys"]
    if keys.required:
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        client = keys.client(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        # the access log and the per-client metrics name the client (or "-": no valid key)
        request.environ[CLIENT_KEY] = client or "-"
        if client is None:
            raise APIError("a valid API key is required: send 'Authorization: Bearer <key>'", 401,
                           code="invalid_api_key", headers={"WWW-Authenticate": 'Bearer realm="appliance"'})
    if not rt.ready:
        if rt.status == "failed":
            raise APIError(f"the model failed to load: {rt.error}", 503, code="model_load_failed")
        if rt.status == "draining":
            raise APIError("the server is shutting down", 503, code="shutting_down",
                           headers={"Retry-After": "5"})
        raise APIError("the model is still loading", 503, code="model_loading", headers={"Retry-After": "2"})


# ---- models, tokenizer --------------------------------------------------------

def _model_card(rt, name: str) -> dict:
    from appliance.server.retrieval_api import serving_task
    return {"id": name, "object": "model", "created": int(rt.started), "owned_by": "appliance",
            "root": rt.engine.model_name, "max_model_len": rt.engine.max_context, "task": serving_task(rt)}


@bp.get("/v1/models")
def list_models():
    rt = runtime()
    return jsonify({"object": "list", "data": [_model_card(rt, n) for n in serving(rt).model_names]})


@bp.get("/v1/models/<path:model_id>")
def get_model(model_id: str):
    rt = runtime()
    if model_id not in serving(rt).model_names:
        raise APIError(f"the model {model_id!r} does not exist", 404, param="model", code="model_not_found")
    return jsonify(_model_card(rt, model_id))


@bp.post("/tokenize")
def tokenize():
    """vLLM's shape: {"prompt"} or {"messages", "tools", "chat_template_kwargs", "add_generation_prompt"}."""
    rt = runtime()
    body = read_json_body()
    defaults = serving(rt)
    check_model(body, defaults.model_names)
    tok = rt.engine.tokenizer
    if "messages" in body:
        messages = chat.parse_messages(body)
        tools = chat.parse_tools(body)
        kwargs = chat.template_kwargs(body, defaults.chat_template_kwargs)
        text = chat.render(rt.engine, messages, tools, kwargs, get_bool(body, "add_generation_prompt", True))
    elif "prompt" in body:
        text = body["prompt"]
        if not isinstance(text, str):
            raise APIError("prompt: expected a string", param="prompt", code="invalid_type")
    else:
        raise APIError("either prompt or messages is required", param="prompt", code="missing_required_parameter")
    ids = tok.encode(text)
    return jsonify({"tokens": ids, "count": len(ids), "max_model_len": rt.engine.max_context})


@bp.post("/detokenize")
def detokenize():
    rt = runtime()
    body = read_json_body()
    check_model(body, serving(rt).model_names)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise APIError("tokens: expected an array of integer token ids", param="tokens", code="invalid_type")
    vocab = int(rt.info.get("vocab") or 0)
    bad = [t for t in ids if t < 0 or (vocab and t >= vocab)]
    if bad:
        raise APIError(f"tokens: token id {bad[0]} is outside the vocabulary [0, {vocab})",
                       param="tokens", code="invalid_value")
    return jsonify({"prompt": rt.engine.tokenizer.decode(ids)})


# ---- generation -----------------------------------------------------------------

@bp.post("/v1/chat/completions")
def chat_completions():
    rt = runtime()
    return _generate(parse_chat(read_json_body(), rt.engine, image_policy(rt.settings), serving(rt)))


@bp.post("/v1/completions")
def completions():
    rt = runtime()
    return _generate(parse_completion(read_json_body(), rt.engine, serving(rt)))


class ClientWatch:
    """Tells whether the client closed its connection, without reading its data."""

    def __init__(self, environ):
        sock = environ.get("gunicorn.socket")
        self.fd = sock.fileno() if sock is not None else None

    def gone(self) -> bool:
        if self.fd is None:
            return False
        try:
            poller = select.poll()
            poller.register(self.fd, select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLRDHUP)
            events = poller.poll(0)
            if not events:
                return False
            mask = events[0][1]
            if mask & (select.POLLHUP | select.POLLERR | select.POLLRDHUP | select.POLLNVAL):
                return True
            return False   # readable data (a pipelined request) is not a disconnect
        except (OSError, ValueError):
            return True


def _submit(gen: GenerationRequest):
    rt = runtime()
    try:
        return rt.scheduler.submit(gen.prompt_ids, gen.params, images=gen.images, session=session_key())
    except QueueFullError as e:
        rt.metrics.count("rejected")
        raise APIError(f"{e}; retry later", 503, code="queue_full",
                       headers={"Retry-After": str(e.retry_after)}) from None
    except ShuttingDownError as e:
        rt.metrics.count("rejected")
        raise APIError(str(e), 503, code="shutting_down", headers={"Retry-After": str(e.retry_after)}) from None


def session_key() -> str | None:
    """The conversation a request belongs to: its X-Session-Id, else the name of its API key
    (never the key itself: the scheduler logs it)."""
    value = request.headers.get(SESSION_HEADER)
    if value is None:
        client = request.environ.get(CLIENT_KEY)
        return client if client not in (None, "-") else None
    value = value.strip()
    if not value or len(value) > MAX_SESSION_CHARS or not value.isprintable():
        raise APIError(f"{SESSION_HEADER}: expected 1-{MAX_SESSION_CHARS} printable characters", param=SESSION_HEADER,
                       code="invalid_value")
    return value


def record_usage(environ, fin: Finished) -> None:
    """The request's token counts, for its access log line."""
    environ[USAGE_KEY] = {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens}


def _generate(gen: GenerationRequest):
    rt = runtime()
    req = _submit(gen)
    reply = Reply(gen, rt.engine.tokenizer, rt.info)
    watch = ClientWatch(request.environ)
    if gen.stream:
        return Response(_stream(rt, req, reply, watch, request.environ), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        while True:
            ev = req.next_event(POLL_S)
            if watch.gone():
                rt.scheduler.cancel(req)
                raise APIError("the client closed the connection", 499, code="client_closed")
            if ev is None:
                continue
            if isinstance(ev, Finished):
                break
            reply.add(ev)
    finally:
        rt.scheduler.cancel(req)          # no-op once finished
    record_usage(request.environ, ev)
    if ev.outcome not in ("stop", "length"):
        raise _failure(ev)
    body = reply.body(ev)
    _count_tool_calls(rt, reply)
    return jsonify(body)


def _count_tool_calls(rt, reply: Reply) -> None:
    if reply.tool_stats is not None:
        rt.metrics.observe(reply.tool_stats)

# The scheduler's refusals (scheduler.REFUSALS) as OpenAI error codes.
REFUSAL_CODES = {"prompt_too_long": "context_length_exceeded", "invalid_prompt": "invalid_value"}


def _failure(fin: Finished) -> APIError:
    if fin.outcome == "timeout":
        return APIError(fin.message, 504, code="request_timeout", type="timeout_error")
    if fin.outcome in ("shutdown", "cancelled"):
        return APIError(fin.message or "the request was cancelled", 503, code=fin.outcome,
                        headers={"Retry-After": "5"})
    if fin.cause in REFUSAL_CODES:
        return APIError(fin.message, 400, code=REFUSAL_CODES[fin.cause])
    return APIError(fin.message or "generation failed", 500, code="internal_error", type="server_error")


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _stream(rt, req, reply: Reply, watch: ClientWatch, environ: dict):
    """Server-sent events; the finally clause cancels the request if the client left early."""
    try:
        first = reply.first_chunk()
        if first is not None:
            yield _sse(first)
        last_write = time.monotonic()
        while True:
            ev = req.next_event(POLL_S)
            if watch.gone():      # one poll() per token: a departed client is cancelled before the next step
                return
            if ev is None:
                if time.monotonic() - last_write > KEEPALIVE_S:
                    last_write = time.monotonic()
                    yield ": keep-alive\n\n"
                continue
            if isinstance(ev, Finished):
                record_usage(environ, ev)
                if ev.outcome in ("stop", "length"):
                    for chunk in reply.finish_chunks(ev):
                        yield _sse(chunk)
                    _count_tool_calls(rt, reply)
                    if reply.gen.include_usage:
                        yield _sse(reply.usage_chunk(ev))
                else:
                    yield _sse(_failure(ev).body())
                yield "data: [DONE]\n\n"
                return
            chunks = reply.token_chunks(ev)
            for chunk in chunks:
                yield _sse(chunk)
            if chunks:
                last_write = time.monotonic()
    finally:
        rt.scheduler.cancel(req)
