"""The Flask app factory: create_app() builds config, runtime and blueprints.

    create_app()                                  settings from APPLIANCE_* / APPLIANCE_CONFIG
    create_app({"settings": Settings(...)})       explicit settings (the gunicorn launcher)
    create_app({"engine": engine, ...})           an already loaded engine (in-process tests)

The model loads in a background thread: /health answers 503 until it is ready.
"""
from __future__ import annotations

import os
from pathlib import Path

from flask import Flask

from appliance.api_keys import KeyRing
from appliance.config import Settings, load_settings
from appliance.server.access_log import AccessLog
from appliance.server.errors import register_error_handlers
from appliance.server.runtime import Runtime


def web_dir() -> Path:
    """web/ (templates + static): APPLIANCE_WEB_DIR, the source tree, or installed package data."""
    here = Path(__file__).resolve().parent
    candidates = [os.environ.get("APPLIANCE_WEB_DIR"), here.parent.parent / "web", here.parent / "web"]
    for c in candidates:
        if c and (Path(c) / "templates" / "index.html").is_file():
            return Path(c)
    raise FileNotFoundError("dashboard files not found: set APPLIANCE_WEB_DIR to the web/ directory")


def create_app(test_config: dict | None = None) -> Flask:
    cfg = dict(test_config or {})
    settings = cfg.pop("settings", None)
    engine = cfg.pop("engine", None)
    if settings is None:
        overrides = {k: cfg.pop(k) for k in list(cfg) if k in Settings.__dataclass_fields__}
        settings = load_settings(overrides=overrides)

    web = web_dir()
    app = Flask(__name__, template_folder=str(web / "templates"), static_folder=str(web / "static"),
                static_url_path="/static")
    app.config.update(MAX_CONTENT_LENGTH=settings.max_body_bytes, JSON_SORT_KEYS=False)
    app.config.update(cfg)
    app.json.sort_keys = False
    app.json.ensure_ascii = False

    runtime = Runtime(settings)
    app.extensions["appliance"] = runtime
    app.extensions["appliance_api_keys"] = KeyRing(settings.api_key, settings.api_keys_file)
    register_error_handlers(app)

    from appliance.server import dashboard, openai_api, openapi, ops, retrieval_api
    app.register_blueprint(ops.bp)
    app.register_blueprint(openapi.bp)
    app.register_blueprint(openai_api.bp)
    app.register_blueprint(retrieval_api.bp)
    app.register_blueprint(dashboard.bp)

    app.wsgi_app = AccessLog(app.wsgi_app, runtime.metrics)
    runtime.start(engine=engine, background=True)
    return app
