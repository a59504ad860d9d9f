"""`schemathesis run` fuzzes a live server from its own GET /openapi.json: requests that fit the
published schema and requests that break it (its coverage and fuzzing phases), on every
operation. No answer is a 5xx; every status, content type and JSON body is one the document
declares; every error is the JSON error object (schemathesis_hooks.py); the server is healthy
and idle afterwards. A chat, an embedding and a reranking server; about 40 s each here."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from live_server import serving
from tiny_models_retrieval import embedding_dir, reranker_dir  # noqa: F401 (fixtures)

HERE = Path(__file__).resolve().parent
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance",
          "response_schema_conformance", "every_error_is_the_json_error_object")
EXAMPLES = 20                       # per operation in the fuzzing phase; the coverage phase adds its own


@pytest.fixture(scope="module", params=["chat", "embed", "rerank"])
def fuzzed_server(request):
    """One server per task; a short context, so that a valid request that asks for every token
    it may is still quick."""
    model_dir = request.getfixturevalue({"chat": "server_model_dir", "embed": "embedding_dir",
                                         "rerank": "reranker_dir"}[request.param])
    with serving(model_dir, "--task", request.param, "--max-batch", "4", "--max-queue", "8",
                 "--max-context", "256", "--request-timeout", "30", "--max-body-bytes", "262144") as srv:
        srv.task = request.param
        yield srv


@pytest.mark.slow
def test_the_server_keeps_to_its_published_schema(fuzzed_server, tmp_path):
    env = dict(os.environ, SCHEMATHESIS_HOOKS="schemathesis_hooks",
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    cmd = [str(SCHEMATHESIS), "run", fuzzed_server.base + "/openapi.json", "--checks", ",".join(CHECKS),
           "--phases", "examples,coverage,fuzzing", "--mode", "all", "--max-examples", str(EXAMPLES),
           "--seed", "1", "--workers", "1", "--request-timeout", "60", "--generation-database", "none",
           "--no-color", "--report", "junit", "--report-dir", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "9 selected" in run.stdout and " passed" in run.stdout, run.stdout[-3000:]


@pytest.mark.slow
def test_healthy_and_idle_after_the_fuzzing(fuzzed_server):
    assert fuzzed_server.health()["status"] == "ready"
    assert fuzzed_server.wait_idle()["kv_blocks_used"] == 0
    path, body = {"chat": ("/v1/completions", {"prompt": "still there?", "max_tokens": 2}),
                  "embed": ("/v1/embeddings", {"input": "still there?"}),
                  "rerank": ("/v1/rerank", {"query": "still there?", "documents": ["yes", "no"]})}[fuzzed_server.task]
    assert fuzzed_server.post(path, json=body).status_code == 200
