"""Locust users for the appliance: streaming chats, as a chat front end sends them.

Each user streams a chat completion, reads it to the end, then thinks for a moment. A 503
(queue full, or a board draining) is a refusal the client is told to retry after
`Retry-After` seconds: it is counted as "refused", not as a failure, and the user waits
that long. Anything else that is not a complete stream is a failure.

    locust -f bench/locustfile.py --headless -u 32 -r 8 -t 60s --host http://127.0.0.1:8080
(bench/load_test.py starts a server, runs this and prints the table.)
"""
from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, events, task

MAX_TOKENS = int(os.environ.get("LOAD_MAX_TOKENS", "32"))
QUESTIONS = ["What does json.dumps do?", "Explain os.path.join.", "Tell me about itertools.chain.",
             "What is collections.OrderedDict?", "Explain functools.partial.", "What is pathlib.Path?"]


class ChatUser(HttpUser):
    wait_time = between(0.2, 1.0)

    def on_start(self):
        self.model = self.client.get("/v1/models").json()["data"][0]["id"]

    @task
    def streamed_chat(self):
        body = {"model": self.model, "stream": True, "max_tokens": MAX_TOKENS,
                "messages": [{"role": "user", "content": random.choice(QUESTIONS)}]}
        t0 = time.perf_counter()
        with self.client.post("/v1/chat/completions", json=body, stream=True, catch_response=True,
                              name="chat stream") as r:
            if r.status_code == 503:
                events.request.fire(request_type="REFUSED", name="503 retry-after", response_time=0,
                                    response_length=0, exception=None, context={})
                r.success()
                time.sleep(float(r.headers.get("Retry-After", "1")))
                return
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            chunks, done = 0, False
            for line in r.iter_lines():
                if line == b"data: [DONE]":
                    done = True
                elif line.startswith(b"data: "):
                    json.loads(line[6:])
                    chunks += 1
            if not done:
                r.failure(f"the stream ended without [DONE] after {chunks} chunks")
            else:
                r.success()
                events.request.fire(request_type="STREAM", name="whole stream",
                                    response_time=1e3 * (time.perf_counter() - t0), response_length=chunks,
                                    exception=None, context={})
