"""The live dashboard: `/` (one page, no CDN) and `/dashboard/stats` (its JSON feed).

The page polls the feed once a second with `steps=`, `series=` and `thermal=` set to
the newest time it holds of each, so each poll carries only new points; charts are drawn on plain canvases (web/static/charts.js).
Model output reaches the page only through the chat panel, which sets textContent.
The feed also carries the tables as rows a person reads (appliance/server/dashboard_facts.py)
and what the page must know of the model: whether it is the embedded demo model, and whether
it has a chat template (without one the chat panel sends plain completions).
"""
from __future__ import annotations

import time

from flask import Blueprint, current_app, jsonify, render_template, request

from appliance.server.dashboard_facts import model_rows, setting_rows

bp = Blueprint("dashboard", __name__)

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")


def runtime():
    return current_app.extensions["appliance"]


def model_notes(engine) -> dict:
    """What the chat panel adapts to; empty until the model is loaded."""
    if engine is None:
        return {}
    from appliance.engine import DEMO_MODEL_DIR

    return {"demo": engine.model_dir.resolve() == DEMO_MODEL_DIR.resolve(),
            "chat_template": bool(engine.tokenizer.has_chat_template)}


@bp.after_app_request
def _security_headers(resp):
    if resp.mimetype == "text/html":
        resp.headers["Content-Security-Policy"] = CSP
    resp.headers["X-Content-Type-Options"] = "nosniff"
    resp.headers["Referrer-Policy"] = "no-referrer"
    return resp


@bp.get("/")
def index():
    rt = runtime()
    return render_template("index.html", settings=rt.settings.public(), status=rt.status,
                           auth_required=bool(rt.settings.api_key or rt.settings.api_keys_file))


@bp.get("/dashboard/stats")
def stats():
    rt = runtime()
    def since(name: str) -> float:
        try:
            return float(request.args.get(name, "0"))
        except ValueError:
            return 0.0

    out = rt.live.snapshot(since("steps"), since("series"))
    thermal_since = since("thermal")
    snap = rt.thermal.snapshot()
    out.update({
        "now": time.time(),
        "status": rt.status,
        "error": rt.error,
        "model": rt.model_facts(),
        "model_notes": model_notes(rt.engine),
        "settings": rt.settings.public(),
        "rows": {"model": model_rows(rt.model_facts()), "settings": setting_rows(rt.settings)},
        "queue": rt.queue_facts(),
        "auth_required": bool(rt.settings.api_key or rt.settings.api_keys_file),
        "thermal": None if snap is None else snap.to_dict(),
        "throttled_seconds": {k: round(v, 1) for k, v in rt.thermal.throttled_seconds.items()},
        "thermal_history": [
            {"t": round(s.time, 3),
             "zones": {z.name: z.temp_c for z in s.zones},
             "policies": {p.name: {"cur_hz": p.cur_hz, "throttled": p.throttled} for p in s.policies}}
            for s in list(rt.thermal.history)[-300:] if s.time > thermal_since],
    })
    return jsonify(out)
