"""GET /openapi.json: the API as an OpenAPI 3.1 document, built from the request field tables
(request_fields.py) that validation reads, with the loaded model's bounds (served names,
vocabulary, embedding size) filled in.

Responses are described by the shapes the handlers return; every 4xx and 5xx is the one error
object ({"error": {"message", "type", "param", "code"}}). Clients and gateways generate code
from it; the test suite fuzzes the live server against it with schemathesis.
"""
from __future__ import annotations

from flask import Blueprint, current_app, jsonify

import appliance
from appliance.server import request_fields as rf

bp = Blueprint("openapi", __name__)

JSON = "application/json"
_INT, _STR, _NUM = {"type": "integer"}, {"type": "string"}, {"type": "number"}
_NULLABLE_STR = {"type": ["string", "null"]}
ERROR = {"type": "object", "required": ["error"],
         "properties": {"error": {"type": "object", "required": ["message", "type", "param", "code"],
                                  "properties": {"message": _STR, "type": _STR, "param": _NULLABLE_STR,
                                                 "code": _NULLABLE_STR}}}}
USAGE = {"type": "object", "required": ["prompt_tokens", "total_tokens"],
         "properties": {"prompt_tokens": _INT, "completion_tokens": _INT, "total_tokens": _INT,
                        "prompt_tokens_details": {"type": "object", "properties": {"cached_tokens": _INT}},
                        "completion_tokens_details": {"type": "object"}}}
_FINISH = {"type": ["string", "null"], "enum": ["stop", "length", "tool_calls", None]}
_COMPLETION_COMMON = {"id": _STR, "created": _INT, "model": _STR, "system_fingerprint": _NULLABLE_STR,
                      "usage": USAGE}
CHAT_COMPLETION = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {**_COMPLETION_COMMON, "object": {"const": "chat.completion"},
                   "choices": {"type": "array", "items": {
                       "type": "object", "required": ["index", "message", "finish_reason"],
                       "properties": {"index": _INT, "finish_reason": _FINISH,
                                      "logprobs": {"type": ["object", "null"]},
                                      "message": {"type": "object", "required": ["role", "content"],
                                                  "properties": {"role": {"const": "assistant"},
                                                                 "content": _NULLABLE_STR,
                                                                 "reasoning_content": _NULLABLE_STR,
                                                                 "tool_calls": {"type": "array"}}}}}}}}
TEXT_COMPLETION = {
    "type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
    "properties": {**_COMPLETION_COMMON, "object": {"const": "text_completion"},
                   "choices": {"type": "array", "items": {
                       "type": "object", "required": ["index", "text", "finish_reason"],
                       "properties": {"index": _INT, "text": _STR, "finish_reason": _FINISH,
                                      "logprobs": {"type": ["object", "null"]}}}}}}
EMBEDDING_LIST = {
    "type": "object", "required": ["object", "data", "model", "usage"],
    "properties": {"object": {"const": "list"}, "model": _STR, "usage": USAGE,
                   "data": {"type": "array", "items": {
                       "type": "object", "required": ["object", "index", "embedding"],
                       "properties": {"object": {"const": "embedding"}, "index": _INT,
                                      "embedding": {"anyOf": [{"type": "array", "items": _NUM}, _STR]}}}}}}
RERANK_RESULT = {
    "type": "object", "required": ["id", "model", "results", "usage"],
    "properties": {"id": _STR, "object": _STR, "model": _STR, "usage": USAGE,
                   "results": {"type": "array", "items": {
                       "type": "object", "required": ["index", "relevance_score"],
                       "properties": {"index": _INT, "relevance_score": _NUM,
                                      "document": {"type": "object", "properties": {"text": _STR}}}}}}}
MODEL_CARD = {"type": "object", "required": ["id", "object", "created", "owned_by"],
              "properties": {"id": _STR, "object": {"const": "model"}, "created": _INT, "owned_by": _STR,
                             "root": _STR, "max_model_len": _INT,
                             "task": {"enum": ["chat", "embed", "rerank"]}}}
MODEL_LIST = {"type": "object", "required": ["object", "data"],
              "properties": {"object": {"const": "list"}, "data": {"type": "array", "items": MODEL_CARD}}}
TOKENS = {"type": "object", "required": ["tokens", "count", "max_model_len"],
          "properties": {"tokens": {"type": "array", "items": _INT}, "count": _INT, "max_model_len": _INT}}
TEXT = {"type": "object", "required": ["prompt"], "properties": {"prompt": _STR}}
HEALTH = {"type": "object", "required": ["status"],
          "properties": {"status": {"enum": ["loading", "ready", "draining", "failed"]},
                         "uptime_s": _NUM, "error": _STR, "load": {}, "model": {"type": "object"},
                         "queue": {"type": "object"}, "throttled": {"type": ["boolean", "null"]}}}

# (method, path, request table or None, summary, 200 response, other statuses it may answer)
GENERATING = (400, 401, 404, 413, 415, 499, 500, 503, 504)
ROUTES = (
    ("post", "/v1/chat/completions", rf.CHAT, "a chat reply (stream: server-sent events)", CHAT_COMPLETION,
     GENERATING),
    ("post", "/v1/completions", rf.COMPLETION, "a completion of a prompt (stream: server-sent events)",
     TEXT_COMPLETION, GENERATING),
    ("post", "/v1/embeddings", rf.EMBEDDINGS, "embedding vectors (a server with task embed)", EMBEDDING_LIST,
     GENERATING),
    ("post", "/v1/rerank", rf.RERANK, "documents ranked for a query (a server with task rerank)", RERANK_RESULT,
     GENERATING),
    ("get", "/v1/models", None, "the names this server answers to", MODEL_LIST, (401, 503)),
    ("post", "/tokenize", rf.TOKENIZE, "token ids of a prompt or of a rendered chat", TOKENS,
     (400, 401, 404, 413, 415, 503)),
    ("post", "/detokenize", rf.DETOKENIZE, "the text of token ids", TEXT, (400, 401, 404, 413, 415, 503)),
    ("get", "/health", None, "the server's state and the model's facts (503 while loading or failed)", HEALTH,
     ()),
)
OPEN_PATHS = ("/health", "/metrics", "/openapi.json")      # never behind the API key
STREAMED = ("/v1/chat/completions", "/v1/completions")


def request_schema(fields: dict[str, rf.Field], facts: rf.ServedFacts) -> dict:
    return {"type": "object",
            "required": [name for name, f in fields.items() if f.required],
            "properties": {name: f.schema(facts) for name, f in fields.items()}}


def document(facts: rf.ServedFacts, auth: bool) -> dict:
    paths: dict = {}
    for method, path, fields, summary, ok, statuses in ROUTES:
        op: dict = {"summary": summary, "operationId": path.strip("/").replace("/", "_").replace(".", "_"),
                    "responses": {"200": _response(ok, path in STREAMED)}}
        if path == "/health":
            op["responses"]["503"] = _response(HEALTH)
        for status in statuses:
            op["responses"][str(status)] = {"description": "an error", "content": {JSON: {"schema": ERROR}}}
        if fields is not None:
            op["requestBody"] = {"required": True,
                                 "content": {JSON: {"schema": request_schema(fields, facts)}}}
        if path in OPEN_PATHS:
            op["security"] = []
        paths[path] = {method: op}
    paths["/metrics"] = {"get": {"summary": "Prometheus metrics (text exposition format)", "operationId": "metrics",
                                 "security": [],
                                 "responses": {"200": {"description": "the metrics",
                                                       "content": {"text/plain": {"schema": _STR}}}}}}
    doc: dict = {"openapi": "3.1.0",
                 "info": {"title": "appliance", "version": getattr(appliance, "__version__", "0"),
                          "description": "An OpenAI-compatible server of Qwen3 models on CPUs. Fields left out or "
                                         "null take their defaults; every error is the error object, naming "
                                         "the field in param."},
                 "paths": paths,
                 "components": {"schemas": {"Error": ERROR}}}
    if auth:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        doc["security"] = [{"bearer": []}]
    return doc


def _response(schema: dict, streamed: bool = False) -> dict:
    content = {JSON: {"schema": schema}}
    if streamed:
        content["text/event-stream"] = {"schema": {"type": "string",
                                                   "description": "data: <chunk JSON> lines, then data: [DONE]"}}
    return {"description": "the result", "content": content}


def served_facts(rt) -> rf.ServedFacts:
    if rt.engine is None or not rt.ready:
        return rf.ServedFacts()
    from appliance.server.openai_api import serving
    return rf.ServedFacts.of(rt.engine, serving(rt).model_names)


def auth_required(rt) -> bool:
    keys = current_app.extensions.get("appliance_api_keys")
    return bool(keys.required) if keys is not None else bool(rt.settings.api_key)


@bp.get("/openapi.json")
def openapi_json():
    rt = current_app.extensions["appliance"]
    return jsonify(document(served_facts(rt), auth_required(rt)))
