#!/usr/bin/env python3
"""Records what Alertmanager's webhook receivers deliver, one JSON line per notification.

    webhook_receiver.py --bind 10.78.0.1 --port 9095 --dir DIR

A POST to /<receiver> appends {"received": <unix time>, "payload": <body>} to
DIR/<receiver>.jsonl; GET /<receiver> answers the lines so far. The lab's inventory
points every Alertmanager receiver at http://<controller>:9095/<receiver name>, so a test
reads exactly which notifications reached whom, and how often.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

NAME = re.compile(r"^/([A-Za-z0-9_.-]{1,64})/?$")


def make_handler(directory: str):
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _path(self) -> str | None:
            m = NAME.match(self.path)
            return os.path.join(directory, m.group(1) + ".jsonl") if m else None

        def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
            path = self._path()
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length)
            try:
                payload = json.loads(body)
            except ValueError:
                path = None
            if path is None:
                self.send_error(400, "POST /<receiver> with a JSON body")
                return
            with lock, open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps({"received": time.time(), "payload": payload}) + "\n")
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_GET(self) -> None:  # noqa: N802
            path = self._path()
            if path is None:
                self.send_error(404)
                return
            data = open(path, "rb").read() if os.path.exists(path) else b""
            self.send_response(200)
            self.send_header("Content-Type", "application/jsonl")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:
            pass

    return Handler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bind", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=9095)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    ThreadingHTTPServer((a.bind, a.port), make_handler(a.dir)).serve_forever()


if __name__ == "__main__":
    main()
