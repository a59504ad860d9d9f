"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with a 4xx/5xx status."""
from __future__ import annotations

import logging

from flask import Flask, jsonify, request
from werkzeug.exceptions import HTTPException

log = logging.getLogger("appliance.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    """Raised anywhere in a request; answered as an OpenAI-shaped JSON error."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self):
        resp = jsonify(self.body())
        resp.status_code = self.status
        for k, v in self.headers.items():
            resp.headers[k] = v
        return resp


def _from_http(e: HTTPException) -> APIError:
    code = e.code or 500
    messages = {
        404: "no such endpoint",
        405: "method not allowed for this endpoint",
        413: "the request body is too large",
    }
    message = messages.get(code) or (e.description or e.name)
    headers = {}
    if code == 405 and getattr(e, "valid_methods", None):
        headers["Allow"] = ", ".join(e.valid_methods)
    return APIError(message, code, code=e.name.lower().replace(" ", "_"), headers=headers)


def register_error_handlers(app: Flask) -> None:
    @app.errorhandler(APIError)
    def _api_error(e: APIError):
        runtime = app.extensions.get("appliance")
        if runtime is not None and e.status in (400, 404, 413, 422) and request.path.startswith("/v1/"):
            runtime.metrics.count("invalid")
        return e.response()

    @app.errorhandler(HTTPException)
    def _http_error(e: HTTPException):
        return _api_error(_from_http(e))

    @app.errorhandler(Exception)
    def _unexpected(e: Exception):
        log.exception("unhandled error")
        return APIError("internal server error", 500, code="internal_error", type="server_error").response()
