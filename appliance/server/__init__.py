"""Serving: the Flask app (app.py) with its blueprints (OpenAI API, dashboard, ops routes), request
validation and errors, the scheduler in front of the engine, the gunicorn launcher, and the
image URL fetcher (the only network client).

    from appliance.server import create_app

Importing a submodule (the scheduler, say) does not import Flask: create_app is loaded on use.
"""


def create_app(test_config: dict | None = None):
    from appliance.server.app import create_app as build
    return build(test_config)


__all__ = ["create_app"]
