"""`appliance serve`: the Flask app under gunicorn.

One worker (the model is loaded once, in the worker, after the fork), gthread
threads sized for every stream that may be open (running + waiting + probes), a
control socket per instance (gunicorn >= 25 otherwise shares $HOME/.gunicorn), and
SIGTERM wired to the scheduler: stop admitting, let running requests finish within
the grace period, then exit.

The `appliance serve` command (appliance/cli) calls add_serve_arguments(parser) and run_serve(args).
"""
from __future__ import annotations

import argparse
import ctypes
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time

from appliance.config import ConfigError, Settings, add_setting_flags, model_dir_problem, settings_from_flags

log = logging.getLogger("appliance.serve")

def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every command-line setting (appliance/config.py defines them), the settings file, and the
    gunicorn control socket."""
    parser.add_argument("--config", metavar="FILE", help="YAML settings file (also APPLIANCE_CONFIG)")
    add_setting_flags(parser)
    parser.add_argument("--control-socket", metavar="PATH",
                        help="gunicorn control socket (default: one per host:port in the temp dir)")


def settings_from_args(args: argparse.Namespace, environ=None) -> Settings:
    return settings_from_flags(args, config_file=getattr(args, "config", None), environ=environ)


MALLOC_ARENAS = 2


def limit_malloc_arenas() -> None:
    """At most MALLOC_ARENAS glibc malloc arenas (unless MALLOC_ARENA_MAX says otherwise).

    glibc gives up to 8 arenas per core to a process's threads, and every HTTP thread of
    the gthread worker can end up with its own: in a 2,000-request soak the worker's RSS
    grew 7% and kept growing; with two arenas it started 5 MB lower and grew a third as much.
    The hot paths are in C and numpy and hardly call malloc, so the extra locking costs
    nothing measurable. Set before gunicorn forks and starts threads; no-op off glibc."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_ARENA_MAX, MALLOC_ARENAS)
    except (OSError, AttributeError):
        pass


M_ARENA_MAX = -8             # glibc's mallopt parameter number


def port_taken(host: str, port: int) -> str | None:
    """Why the address cannot be bound (None: it can). gunicorn alone retries five times and
    ends with "Can't connect", which names neither the cause nor the flag."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)     # as gunicorn binds
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def default_control_socket(settings: Settings) -> str:
    tag = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{settings.host}-{settings.port}")
    return os.path.join(tempfile.gettempdir(), f"appliance-gunicorn-{tag}.ctl")


def _gunicorn_settings() -> set[str]:
    from gunicorn.config import KNOWN_SETTINGS
    return {s.name for s in KNOWN_SETTINGS}


def _bind_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def dashboard_url(settings: Settings) -> str:
    host = settings.host
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    return f"http://{_bind_address(host, settings.port)}/"


def gunicorn_options(settings: Settings, control_socket: str | None = None) -> dict:
    known = _gunicorn_settings()
    opts = {
        "bind": [_bind_address(settings.host, settings.port)],
        "workers": 1,
        "worker_class": "gthread",
        "threads": settings.http_threads,
        "timeout": 120,                          # heartbeat only: gthread's main loop keeps beating
        # The drain (grace period), then the prefix cache's flush to disk at exit (up to as long again).
        "graceful_timeout": int(2 * max(settings.grace_period, 5.0)) + 5,
        "keepalive": 5,
        "proc_name": f"appliance:{settings.port}",
        "accesslog": None,
        "errorlog": "-",
        "loglevel": settings.log_level,
        "preload_app": False,                    # load the model in the worker, after the fork
    }
    if "control_socket" in known:
        opts["control_socket"] = control_socket or default_control_socket(settings)
    return {k: v for k, v in opts.items() if k in known}


# ---- gunicorn hooks (module level so that gunicorn can call them by reference) ----

def _when_ready(server) -> None:
    settings = server.app.settings
    model = "the embedded demo model" if settings.model is None else settings.model
    print(f"appliance: dashboard and API at {dashboard_url(settings)} (loading {model}; "
          f"/health turns 200 when ready)", flush=True)


def _post_worker_init(worker) -> None:
    """SIGTERM in the worker: drain first, and only then gunicorn's own graceful stop.

    While draining the worker keeps accepting connections, so a new request and /ready get a
    503 (with Retry-After) at once: a load balancer learns from the answer, not from its own
    timeout. gunicorn's stop (no more accepting) begins when the last running request is done
    or the grace period is over."""
    runtime = worker.wsgi.extensions["appliance"]

    def on_term(signum, frame):
        if runtime.status == "draining":
            return                                   # a second SIGTERM: the drain is under way
        runtime.begin_drain()
        threading.Thread(target=_stop_when_drained, args=(worker, runtime, signum, frame),
                         name="drain", daemon=True).start()

    signal.signal(signal.SIGTERM, on_term)
    signal.siginterrupt(signal.SIGTERM, False)


def _stop_when_drained(worker, runtime, signum, frame) -> None:
    deadline = time.monotonic() + runtime.settings.grace_period + 1.0
    while time.monotonic() < deadline and not runtime.idle():
        time.sleep(0.05)
    worker.handle_exit(signum, frame)


def _worker_exit(server, worker) -> None:
    app = getattr(worker, "wsgi", None)
    runtime = getattr(app, "extensions", {}).get("appliance") if app is not None else None
    if runtime is not None:
        runtime.close()


def _application_class():
    from gunicorn.app.base import BaseApplication

    class ApplianceServer(BaseApplication):
        def __init__(self, settings: Settings, options: dict):
            self.settings = settings
            self.options = options
            super().__init__()

        def load_config(self):
            for key, value in self.options.items():
                self.cfg.set(key, value)
            self.cfg.set("when_ready", _when_ready)
            self.cfg.set("post_worker_init", _post_worker_init)
            self.cfg.set("worker_exit", _worker_exit)

        def load(self):
            # force: the worker's log format and level are the server's, whatever the CLI set up.
            logging.basicConfig(level=getattr(logging, self.settings.log_level.upper()), force=True,
                                format="[%(asctime)s] [%(process)d] [%(levelname)s] %(name)s: %(message)s")
            from appliance.server import create_app
            return create_app({"settings": self.settings})

    return ApplianceServer


def run_serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as e:
        print(f"appliance serve: {e}", file=sys.stderr)
        return 2
    problem = model_dir_problem(settings)
    if problem:
        print(f"appliance serve: {problem}; serving /health with the reason until it is fixed",
              file=sys.stderr)
    limit_malloc_arenas()
    taken = port_taken(settings.host, settings.port)
    if taken:
        print(f"appliance serve: {settings.host}:{settings.port} is already in use ({taken}); another "
              f"server may be running there: stop it, or choose another port with --port", file=sys.stderr)
        return 2
    options = gunicorn_options(settings, getattr(args, "control_socket", None))
    server = _application_class()(settings, options)
    try:
        server.run()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0
