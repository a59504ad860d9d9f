"""One log line per request, when its response is done (a stream included):

    GET /health 200 0.8 ms
    POST /v1/chat/completions 200 4312.5 ms client=kiosk-2 prompt_tokens=41 completion_tokens=64 stream

WSGI middleware, so the time of a streamed reply is counted to its last byte. Never the
prompt or the reply: a handler adds what it knows (token counts) to
environ[USAGE_KEY] and it is logged beside the method, path, status and time; the name of
the API key the request came with (environ[CLIENT_KEY], "-" for none that is valid) is logged
and counted per client by the metrics, never the key. Polling that
succeeds (load balancer and Prometheus probes, the dashboard's refresh) is logged at debug
level only: every few seconds from every poller would bury the requests.
"""
from __future__ import annotations

import logging
import time

log = logging.getLogger("appliance.access")
USAGE_KEY = "appliance.usage"          # environ entry: {"prompt_tokens": n, "completion_tokens": n, ...}
CLIENT_KEY = "appliance.client"        # environ entry: the API key's name
POLLED = ("/health", "/ready", "/metrics", "/dashboard/stats", "/static/")


class AccessLog:
    def __init__(self, app, metrics=None):
        self.app = app
        self.metrics = metrics

    def __call__(self, environ, start_response):
        t0 = time.perf_counter()
        status = ["-"]

        def recording_start_response(code, headers, exc_info=None):
            status[0] = code.split(" ", 1)[0]
            return start_response(code, headers, exc_info)

        body = self.app(environ, recording_start_response)
        return _Logged(body, lambda: self._log(environ, status[0], time.perf_counter() - t0))

    def _log(self, environ, status: str, seconds: float) -> None:
        path = environ.get("PATH_INFO", "")
        client = environ.get(CLIENT_KEY)
        usage = environ.get(USAGE_KEY) or {}
        if client is not None and self.metrics is not None:
            self.metrics.count_client(client, status)
        polled = path.startswith(POLLED) and status[:1] in ("2", "3")
        level = logging.DEBUG if polled else logging.INFO
        if not log.isEnabledFor(level):
            return
        extra = "" if client is None else f" client={client}"
        extra += "".join(f" {k}={v}" for k, v in usage.items() if isinstance(v, (int, float, str)))
        log.log(level, "%s %s %s %.1f ms%s", environ.get("REQUEST_METHOD", "-"), path, status, 1e3 * seconds, extra)


class _Logged:
    """The response iterable, with the log line written when the server closes it."""

    def __init__(self, body, on_close):
        self.body, self.on_close = body, on_close

    def __iter__(self):
        return iter(self.body)

    def close(self):
        try:
            if hasattr(self.body, "close"):
                self.body.close()
        finally:
            self.on_close()
