"""/v1/embeddings and /v1/rerank on real gunicorn servers: the `openai` SDK, the Jina / Cohere rerank
shape, every malformed shape answered 4xx naming its field, and one task per server."""
from __future__ import annotations

import base64
import shutil
import time

import numpy as np
import pytest
import requests

from appliance import Engine
from live_server import start_server
from tiny_models_retrieval import embedding_dir, reranker_dir  # noqa: F401 (fixtures)

TEXTS = ["Hello world! How are you today?", "The quick brown fox jumps over the lazy dog.",
         "Python is a programming language"]
QUERY = "what runs on the board?"
DOCS = ["the board runs models.", "Hello world! How are you today?", "yes", "Python is a programming language"]
NAMES = "qwen3-embedding-tiny,text-embedding-3-small"


def _serve(model_dir, *args):
    """A server for the module's tests; it must stop cleanly."""
    srv = start_server(model_dir, "--max-batch", "2", "--max-queue", "4", "--max-context", "256",
                       "--request-timeout", "60", "--grace-period", "3", *args)
    yield srv
    code = srv.stop()
    shutil.rmtree(srv.workdir, ignore_errors=True)
    assert code == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def embed_server(embedding_dir):
    """The task comes from the checkpoint (sentence-transformers files): no --task."""
    yield from _serve(embedding_dir, "--served-model-name", NAMES)


@pytest.fixture(scope="module")
def rerank_server(reranker_dir):
    yield from _serve(reranker_dir, "--task", "rerank")


@pytest.fixture(scope="module")
def local_embedder(embedding_dir):
    """The same checkpoint in this process, loaded as the server loads it (q8 weights and KV)."""
    return Engine.load(embedding_dir, weights="q8", kv="q8", progress=False)


@pytest.fixture
def client(embed_server):
    from openai import OpenAI

    embed_server.wait_idle()
    return OpenAI(base_url=embed_server.base + "/v1", api_key="not-needed", max_retries=0, timeout=60)


# ---- the openai SDK ---------------------------------------------------------------------------

def test_sdk_float_and_base64(client, local_embedder, embed_server):
    floats = client.embeddings.create(model="text-embedding-3-small", input=TEXTS, encoding_format="float")
    assert floats.model == "text-embedding-3-small" and floats.object == "list"
    assert [d.index for d in floats.data] == [0, 1, 2]
    got = np.array([d.embedding for d in floats.data], dtype=np.float32)
    assert np.allclose(got, local_embedder.embed(TEXTS), atol=1e-5)
    ids = [local_embedder.tokenizer.encode(t, add_special_tokens=True) for t in TEXTS]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    # The SDK asks for base64 when encoding_format is left out, and decodes it itself.
    b64 = client.embeddings.create(model="qwen3-embedding-tiny", input=TEXTS)
    assert np.array_equal(np.array([d.embedding for d in b64.data], dtype=np.float32), got)
    raw = embed_server.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4"), got[0])
    assert embed_server.wait_idle()["kv_blocks_used"] == 0


def test_sdk_batch_of_64_and_token_inputs(client, local_embedder):
    texts = [f"{TEXTS[i % 3]} {i}" for i in range(64)]
    r = client.embeddings.create(model="qwen3-embedding-tiny", input=texts, encoding_format="float")
    assert len(r.data) == 64 and [d.index for d in r.data] == list(range(64))
    got = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert np.allclose(got, local_embedder.embed(texts), atol=1e-5)
    ids = local_embedder.tokenizer.encode(texts[5], add_special_tokens=True)
    one = client.embeddings.create(model="qwen3-embedding-tiny", input=[ids], encoding_format="float")
    assert np.allclose(one.data[0].embedding, got[5], atol=1e-5) and one.usage.prompt_tokens == len(ids)


def test_sdk_dimensions(client, local_embedder):
    r = client.embeddings.create(model="qwen3-embedding-tiny", input=TEXTS, dimensions=32, encoding_format="float")
    got = np.array([d.embedding for d in r.data])
    assert got.shape == (3, 32) and np.allclose(np.linalg.norm(got, axis=-1), 1, atol=1e-5)
    assert np.allclose(got, local_embedder.embed(TEXTS, dimensions=32), atol=1e-5)


def test_health_and_metrics_name_the_task(embed_server):
    embed_server.post("/v1/embeddings", json={"input": "Hello"})
    health = embed_server.health()
    assert health["model"]["task"] == "embed"
    m = embed_server.metrics()
    for name in NAMES.split(","):
        key = ("appliance_served_model_info", (("model", "qwen3_embedding0"), ("served_name", name), ("task", "embed")))
        assert m.get(key) == 1.0, sorted(k for k in m if k[0] == "appliance_served_model_info")
    assert m[("appliance_retrieval_inputs_total", (("task", "embed"),))] >= 1
    assert m[("appliance_retrieval_seconds_count", (("task", "embed"),))] >= 1
    assert m[("appliance_requests_total", (("outcome", "stop"),))] >= 1


# ---- the error table ----------------------------------------------------------------------------

LONG = "Hello world! How are you today? " * 40        # well past the 256-token context


@pytest.mark.parametrize("body,param,code", [
    ({}, "input", "missing_required_parameter"),
    ({"input": None}, "input", "missing_required_parameter"),
    ({"input": ""}, "input", "invalid_value"),
    ({"input": []}, "input", "invalid_value"),
    ({"input": [[]]}, "input", "invalid_value"),
    ({"input": ["fine", ""]}, "input", "invalid_value"),
    ({"input": 42}, "input", "invalid_type"),
    ({"input": {"text": "Hello"}}, "input", "invalid_type"),
    ({"input": ["Hello", 3]}, "input", "invalid_type"),
    ({"input": [[1, 2], "Hello"]}, "input", "invalid_type"),
    ({"input": [[1, "2"]]}, "input[0]", "invalid_type"),
    ({"input": [1, 2.5]}, "input", "invalid_type"),
    ({"input": [True, 2]}, "input", "invalid_type"),
    ({"input": [10_000_000]}, "input", "invalid_value"),
    ({"input": [-1]}, "input", "invalid_value"),
    ({"input": LONG}, "input", "context_length_exceeded"),
    ({"input": ["Hello", LONG]}, "input[1]", "context_length_exceeded"),
    ({"input": [[5] * 300]}, "input[0]", "context_length_exceeded"),
    ({"input": ["x"] * 2049}, "input", "invalid_value"),
    ({"input": "Hello", "encoding_format": "int8"}, "encoding_format", "invalid_value"),
    ({"input": "Hello", "encoding_format": 1}, "encoding_format", "invalid_type"),
    ({"input": "Hello", "dimensions": 0}, "dimensions", "invalid_value"),
    ({"input": "Hello", "dimensions": 65}, "dimensions", "invalid_value"),
    ({"input": "Hello", "dimensions": "32"}, "dimensions", "invalid_type"),
    ({"input": "Hello", "user": 7}, "user", "invalid_type"),
    ({"input": "Hello", "model": 7}, "model", "invalid_type"),
])
def test_malformed_embedding_requests(embed_server, body, param, code):
    r = embed_server.post("/v1/embeddings", json=body)
    err = r.json()["error"]
    assert r.status_code == 400, err
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert param.split("[")[0] in err["message"]


def test_unknown_model_and_bad_json(embed_server):
    r = embed_server.post("/v1/embeddings", json={"input": "Hello", "model": "gpt-4o"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = embed_server.post("/v1/embeddings", data="{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert embed_server.wait_idle()["kv_blocks_used"] == 0


def test_one_task_per_server(embed_server, rerank_server, idle_server):
    """A chat request to an embedding server, an embedding request to a chat server, and so on: 400."""
    cases = [(embed_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "embed"),
             (embed_server, "/v1/completions", {"prompt": "Hi"}, "embed"),
             (embed_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}, "embed"),
             (idle_server, "/v1/embeddings", {"input": "Hello"}, "chat"),
             (idle_server, "/v1/rerank", {"query": QUERY, "documents": DOCS}, "chat"),
             (rerank_server, "/v1/embeddings", {"input": "Hello"}, "rerank"),
             (rerank_server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}, "rerank")]
    for server, path, body, task in cases:
        r = server.post(path, json=body)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "unsupported_task" and err["param"] == "model", (path, err)
        assert f"for {task}" in err["message"], err
    assert idle_server.health()["model"]["task"] == "chat"
    # /tokenize serves every task
    assert embed_server.post("/tokenize", json={"prompt": "Hello"}).status_code == 200


def test_models_name_the_task_each_serves(embed_server, rerank_server, idle_server):
    for server, task in [(embed_server, "embed"), (rerank_server, "rerank"), (idle_server, "chat")]:
        cards = server.get("/v1/models").json()["data"]
        assert cards and all(card["task"] == task for card in cards), cards
        assert server.get("/v1/models/" + cards[0]["id"]).json()["task"] == task


def test_an_embedding_request_is_logged_with_its_tokens(embed_server):
    r = embed_server.post("/v1/embeddings", json={"input": ["Hello there, board", "world"]})
    n = r.json()["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 10
    while "POST /v1/embeddings 200 " not in embed_server.log() or f"prompt_tokens={n}" not in embed_server.log():
        assert time.monotonic() < deadline, embed_server.log()[-2000:]
        time.sleep(0.05)
    assert any("POST /v1/embeddings 200" in ln and ln.endswith(f" prompt_tokens={n}")
               for ln in embed_server.log().splitlines())


# ---- /v1/rerank ---------------------------------------------------------------------------------

def test_rerank_shape_and_scores(rerank_server, reranker_dir):
    local = Engine.load(reranker_dir, weights="q8", kv="q8", progress=False)
    expected = local.score(QUERY, DOCS)
    r = rerank_server.post("/v1/rerank", json={"model": "qwen3_reranker0", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == "qwen3_reranker0" and body["id"].startswith("rerank-")
    results = body["results"]
    assert sorted(x["index"] for x in results) == [0, 1, 2, 3]
    assert [x["relevance_score"] for x in results] == sorted((x["relevance_score"] for x in results), reverse=True)
    for x in results:
        assert abs(x["relevance_score"] - expected[x["index"]]) < 1e-5
        assert x["document"] == {"text": DOCS[x["index"]]}
    prompt = local.rerank_prompt()
    n = sum(len(prompt.pair_ids(QUERY, d)) for d in DOCS)
    assert body["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert rerank_server.health()["model"]["task"] == "rerank"
    assert rerank_server.wait_idle()["kv_blocks_used"] == 0


def test_rerank_top_n_objects_and_options(rerank_server):
    full = rerank_server.post("/rerank", json={"query": QUERY, "documents": DOCS}).json()["results"]
    top = rerank_server.post("/v1/rerank", json={"query": QUERY, "documents": [{"text": d} for d in DOCS],
                                                 "top_n": 2, "return_documents": False}).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in full[:2]] and all("document" not in x for x in top)
    assert "document" not in rerank_server.post("/v1/rerank", json={"query": QUERY, "documents": DOCS,
                                                                     "return_text": False}).json()["results"][0]
    other = rerank_server.post("/v1/rerank", json={"query": QUERY, "documents": DOCS,
                                                   "instruction": "Find the passage that names the device"})
    assert other.status_code == 200
    assert [x["relevance_score"] for x in other.json()["results"]] != [x["relevance_score"] for x in full]


@pytest.mark.parametrize("body,param,code", [
    ({"documents": DOCS}, "query", "missing_required_parameter"),
    ({"query": "", "documents": DOCS}, "query", "invalid_value"),
    ({"query": 3, "documents": DOCS}, "query", "invalid_type"),
    ({"query": QUERY}, "documents", "missing_required_parameter"),
    ({"query": QUERY, "documents": []}, "documents", "invalid_value"),
    ({"query": QUERY, "documents": "one"}, "documents", "invalid_type"),
    ({"query": QUERY, "documents": ["ok", 5]}, "documents[1]", "invalid_type"),
    ({"query": QUERY, "documents": [{"title": "x"}]}, "documents[0]", "invalid_type"),
    ({"query": QUERY, "documents": ["x"] * 1001}, "documents", "invalid_value"),
    ({"query": QUERY, "documents": DOCS, "top_n": -1}, "top_n", "invalid_value"),
    ({"query": QUERY, "documents": DOCS, "top_n": "2"}, "top_n", "invalid_type"),
    ({"query": QUERY, "documents": DOCS, "return_documents": "yes"}, "return_documents", "invalid_type"),
    ({"query": QUERY, "documents": DOCS, "instruction": ["x"]}, "instruction", "invalid_type"),
])
def test_malformed_rerank_requests(rerank_server, body, param, code):
    r = rerank_server.post("/v1/rerank", json=body)
    err = r.json()["error"]
    assert r.status_code == 400, err
    assert (err["param"], err["code"]) == (param, code), err


def test_embedding_server_behind_an_api_key(embedding_dir):
    srv = start_server(embedding_dir, "--max-context", "256", "--grace-period", "3", api_key="secret-key-1")
    try:
        assert requests.post(srv.base + "/v1/embeddings", json={"input": "Hi"}, timeout=30).status_code == 401
        # the wrong-task answer too waits for the key
        assert requests.post(srv.base + "/v1/completions", json={"prompt": "Hi"}, timeout=30).status_code == 401
        assert srv.post("/v1/embeddings", json={"input": "Hi"}).status_code == 200
    finally:
        srv.stop()
        shutil.rmtree(srv.workdir, ignore_errors=True)
