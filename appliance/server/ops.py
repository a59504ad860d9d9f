"""Probes and metrics: /health, /ready, /metrics. Always open (no API key), for load
balancers and Prometheus."""
from __future__ import annotations

import dataclasses
import time

from flask import Blueprint, Response, current_app, jsonify

from appliance.server.speculative_params import server_default

bp = Blueprint("ops", __name__)


def runtime():
    return current_app.extensions["appliance"]


@bp.get("/health")
def health():
    """503 while loading (or after a failed load), 200 with model facts when serving."""
    rt = runtime()
    body = {"status": rt.status, "uptime_s": round(time.time() - rt.started, 1)}
    if rt.status == "failed":
        body["error"] = rt.error
    if rt.status == "loading" and rt.load_progress is not None:
        body["load"] = rt.load_progress
    if rt.engine is not None:
        body["model"] = rt.model_facts()
        body["queue"] = rt.queue_facts()
        snap = rt.thermal.snapshot()
        body["throttled"] = None if snap is None else snap.throttled
        body["speculative"] = speculation_facts(rt)
    code = 200 if rt.status in ("ready", "draining") else 503
    return jsonify(body), code


def speculation_facts(rt) -> dict:
    """Whether requests speculate unless they say otherwise (--spec-prompt-lookup), with what,
    and the drafts verified since the start (requests may ask for speculation either way)."""
    default = server_default(rt.settings)
    return {"default": None if default is None else dataclasses.asdict(default), **rt.live.speculation()}


@bp.get("/ready")
def ready():
    """For load balancers: 200 only while new requests are admitted."""
    rt = runtime()
    return jsonify({"status": rt.status}), 200 if rt.ready else 503


@bp.get("/metrics")
def metrics():
    payload, content_type = runtime().metrics.render()
    return Response(payload, content_type=content_type)
