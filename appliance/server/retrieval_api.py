"""Retrieval endpoints: POST /v1/embeddings (OpenAI's shape) and POST /v1/rerank (the Jina / Cohere
shape llama.cpp and vLLM take, also at /rerank), for a model served with task embed or rerank.

A server has one task (settings.task, else what the checkpoint says: Engine.default_task). The
other task's endpoints, and chat or completions on a retrieval server, answer 400 naming the
task it serves. /health shows the task with the model's facts; appliance_served_model_info
carries it with the names the server answers to.

HTTP threads validate and tokenize; the engine work of a request is one scheduler job
(Scheduler.submit_job): it runs on the scheduler's thread between two steps, all inputs of the
request in batched passes, and gives back every KV block it took before the next step.
"""
from __future__ import annotations

import base64
import uuid

import numpy as np
from flask import Blueprint, current_app, jsonify, request

from appliance.config import TASKS
from appliance.engine.encoder import InputTooLongError, encode_inputs
from appliance.server.access_log import USAGE_KEY
from appliance.server.chat import bad, kind
from appliance.server.errors import APIError
from appliance.server.openai_api import POLL_S, ClientWatch, _authorize_and_check_ready, _failure, runtime, serving
from appliance.server.scheduler import Finished, QueueFullError, ShuttingDownError
from appliance.server.request_fields import EMBEDDINGS, ENCODING_FORMATS, MAX_DOCUMENTS, MAX_INPUTS, RERANK, ServedFacts
from appliance.server.validation import check_model, read_json_body

bp = Blueprint("retrieval", __name__)
bp.before_request(_authorize_and_check_ready)

# Which task each endpoint needs (endpoints not listed, like /tokenize, serve every task).
ENDPOINT_TASKS = {"openai.chat_completions": "chat", "openai.completions": "chat",
                  "retrieval.embeddings": "embed", "retrieval.rerank": "rerank"}
TASK_ENDPOINTS = {"chat": "/v1/chat/completions and /v1/completions", "embed": "/v1/embeddings",
                  "rerank": "/v1/rerank"}
assert set(TASK_ENDPOINTS) == set(TASKS)


def serving_task(rt) -> str:
    """The task this server's engine is served for, settled once per loaded engine."""
    held = current_app.extensions.get("appliance_task")
    if held is None or held[0] is not rt.engine:
        task = rt.settings.task or rt.engine.default_task()
        held = current_app.extensions["appliance_task"] = (rt.engine, task)
        rt.info["task"] = task          # /health and the dashboard list it with the model's facts
        rt.metrics.set_served(rt.engine.model_name, serving(rt).model_names, task)
    return held[1]


@bp.before_app_request
def _one_task_per_server():
    rt = runtime()
    if not rt.ready:
        return                          # the blueprints' own checks answer 503
    task = serving_task(rt)
    wanted = ENDPOINT_TASKS.get(request.endpoint)
    if wanted is None:
        return
    _authorize_and_check_ready()        # a client without the key learns no more than a 401
    name = serving(rt).model_names[0]
    if wanted != task:
        raise APIError(f"this server serves {name!r} for {task} ({TASK_ENDPOINTS[task]}); {request.path} needs a "
                       f"model served for {wanted}", 400, param="model", code="unsupported_task")
    if task != "embed" and getattr(rt.engine.model, "lm_head", True) is None:
        raise APIError(f"the model {name!r} has no output head (an embedding checkpoint): serve it with task "
                       f"embed", 400, param="model", code="unsupported_task")


# ---- /v1/embeddings -----------------------------------------------------------------------------

@bp.post("/v1/embeddings")
def embeddings():
    rt = runtime()
    body = read_json_body()
    model = check_model(body, serving(rt).model_names)
    sequences = _embedding_inputs(body, rt.engine)
    fmt = body.get("encoding_format")
    if fmt is None:
        fmt = "float"
    elif fmt not in ENCODING_FORMATS:
        raise bad("encoding_format", f"expected one of {', '.join(ENCODING_FORMATS)}, got {fmt!r}",
                  "invalid_value" if isinstance(fmt, str) else "invalid_type")
    dimensions = EMBEDDINGS["dimensions"].read(body, facts=ServedFacts(embedding_size=rt.engine.embedding_size))
    _optional_string(body, "user")
    vectors = _run_job(rt, lambda engine, stop: engine.embed(sequences, dimensions, stop), sequences)
    n = sum(map(len, sequences))
    request.environ[USAGE_KEY] = {"prompt_tokens": n}
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, fmt)} for i, v in enumerate(vectors)]
    return jsonify({"object": "list", "data": data, "model": model,
                    "usage": {"prompt_tokens": n, "total_tokens": n}})


def _embedding_inputs(body: dict, engine) -> list[list[int]]:
    """`input` in any of OpenAI's four forms -> token ids per input; a 400 naming what is wrong."""
    if "input" not in body or body["input"] is None:
        raise bad("input", "is required", "missing_required_parameter")
    value = body["input"]
    shape = "expected a string, an array of strings, an array of token ids or an array of arrays of token ids"
    if isinstance(value, list):
        if not value:
            raise bad("input", "must not be an empty array")
        if not all(_is_token(v) for v in value):
            if not (all(isinstance(v, str) for v in value) or all(isinstance(v, list) for v in value)):
                raise bad("input", f"{shape}; this array mixes {kind(value[0])} with other kinds", "invalid_type")
            if len(value) > MAX_INPUTS:
                raise bad("input", f"at most {MAX_INPUTS} inputs per request, got {len(value)}")
            for i, item in enumerate(value):
                if isinstance(item, list) and not all(_is_token(t) for t in item):
                    raise bad(f"input[{i}]", "expected an array of integer token ids", "invalid_type")
    elif not isinstance(value, str):
        raise bad("input", f"{shape}, got {kind(value)}", "invalid_type")
    try:
        return encode_inputs(engine, value)
    except InputTooLongError as e:
        param = "input" if not isinstance(value, list) or _is_token(value[0]) else f"input[{e.index}]"
        raise APIError(f"{param} is {e.n_tokens} tokens long but the model's context is {e.max_context} tokens",
                       param=param, code="context_length_exceeded") from None
    except (TypeError, ValueError) as e:
        raise bad("input", str(e)) from None


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _encode(vector: np.ndarray, fmt: str):
    if fmt == "base64":       # little-endian float32, as OpenAI's SDK decodes it
        return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


# ---- /v1/rerank -------------------------------------------------------------------------------

@bp.post("/v1/rerank")
@bp.post("/rerank")
def rerank():
    rt = runtime()
    body = read_json_body()
    model = check_model(body, serving(rt).model_names)
    query = _optional_string(body, "query")
    if not query:
        raise bad("query", "is required (a non-empty string)", "missing_required_parameter" if query is None
                  else "invalid_value")
    documents = _documents(body)
    top_n = RERANK["top_n"].read(body) or len(documents)
    return_documents = RERANK["return_documents"].read(body, RERANK["return_text"].read(body, True))
    instruction = _optional_string(body, "instruction")
    try:
        prompt = rt.engine.rerank_prompt()
    except ValueError as e:
        raise APIError(f"the model {model!r} cannot rerank: {e}", 400, param="model", code="unsupported_task") from None
    sequences = [prompt.pair_ids(query, doc, instruction or None) for doc in documents]
    scores = _run_job(rt, lambda engine, stop: engine.rerank_ids(sequences, stop), sequences)
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": documents[i]}} if return_documents else {})} for i in order]
    n = sum(map(len, sequences))
    request.environ[USAGE_KEY] = {"prompt_tokens": n}
    return jsonify({"id": f"rerank-{uuid.uuid4().hex}", "object": "list", "model": model,
                    "usage": {"prompt_tokens": n, "total_tokens": n}, "results": results})


def _documents(body: dict) -> list[str]:
    """`documents`: strings, or {"text": ...} objects (Cohere's v2, vLLM)."""
    value = body.get("documents")
    if value is None:
        raise bad("documents", "is required", "missing_required_parameter")
    if not isinstance(value, list):
        raise bad("documents", f"expected an array of strings, got {kind(value)}", "invalid_type")
    if not value:
        raise bad("documents", "must not be an empty array")
    if len(value) > MAX_DOCUMENTS:
        raise bad("documents", f"at most {MAX_DOCUMENTS} documents per request, got {len(value)}")
    out = []
    for i, doc in enumerate(value):
        if isinstance(doc, dict) and set(doc) == {"text"}:
            doc = doc["text"]
        if not isinstance(doc, str):
            raise bad(f"documents[{i}]", f"expected a string or {{\"text\": string}}, got {kind(doc)}", "invalid_type")
        out.append(doc)
    return out


def _optional_string(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is not None and not isinstance(v, str):
        raise bad(name, f"expected a string, got {kind(v)}", "invalid_type")
    return v


# ---- running a job ------------------------------------------------------------------------------

def _run_job(rt, job, sequences: list[list[int]]):
    """Queue the engine work on the scheduler and wait for its result (the client leaving cancels it)."""
    try:
        req = rt.scheduler.submit_job(job, [t for s in sequences for t in s])
    except (QueueFullError, ShuttingDownError) as e:
        rt.metrics.count("rejected")
        code = "queue_full" if isinstance(e, QueueFullError) else "shutting_down"
        raise APIError(f"{e}; retry later" if code == "queue_full" else str(e), 503, code=code,
                       headers={"Retry-After": str(e.retry_after)}) from None
    watch = ClientWatch(request.environ)
    result = None
    try:
        while True:
            ev = req.next_event(POLL_S)
            if watch.gone():
                raise APIError("the client closed the connection", 499, code="client_closed")
            if isinstance(ev, Finished):
                break
            if ev is not None:
                result = ev
    finally:
        rt.scheduler.cancel(req)          # no-op once finished
    if ev.outcome != "stop":
        raise _failure(ev)
    return result
