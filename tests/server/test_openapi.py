"""GET /openapi.json: a valid OpenAPI 3.1 document of every route, with the served model's
bounds, built from the same field tables validation reads (checked by recording which fields
the handlers read)."""
from __future__ import annotations

import jsonschema
import pytest
import requests

from appliance.server import request_fields
from appliance.server.openapi import ROUTES

PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/v1/models", "/tokenize",
         "/detokenize", "/health", "/metrics")


@pytest.fixture(scope="module")
def doc(server) -> dict:
    r = requests.get(server.base + "/openapi.json", timeout=10)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json")
    return r.json()


def test_every_route_is_described(doc):
    assert doc["openapi"].startswith("3.1")
    assert set(PATHS) <= set(doc["paths"])
    for path, item in doc["paths"].items():
        for method, op in item.items():
            assert op["responses"]["200"]["content"], (path, method)
            for status, response in op["responses"].items():
                if status.startswith(("4", "5")) and path != "/health":
                    assert response["content"]["application/json"]["schema"]["required"] == ["error"]


def test_request_schemas_are_valid_json_schemas(doc):
    for path, item in doc["paths"].items():
        for op in item.values():
            if "requestBody" in op:
                schema = op["requestBody"]["content"]["application/json"]["schema"]
                jsonschema.Draft202012Validator.check_schema(schema)
                assert schema["type"] == "object" and schema["properties"], path


def test_the_served_model_fills_in_its_bounds(doc, server, model_id):
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["required"] == ["messages"]
    model = chat["properties"]["model"]["anyOf"][0]
    assert model["enum"] == [model_id]
    vocab = server.health()["model"]["vocab"]
    stop_ids = chat["properties"]["stop_token_ids"]["anyOf"][0]
    assert stop_ids["items"]["maximum"] == vocab - 1
    temperature = chat["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 2.0)


def test_the_document_validates_what_the_server_accepts_and_refuses(doc, server, model_id):
    """A request the server answers 200 fits its schema; one that breaks a published bound is a 400."""
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    validator = jsonschema.Draft202012Validator(chat)
    good = {"model": model_id, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "temperature": 0.5, "stop": ["x"], "logit_bias": {"5": -100}, "seed": 3}
    assert validator.is_valid(good)
    assert server.post("/v1/chat/completions", json=good).status_code == 200
    for field, value in [("temperature", 2.5), ("top_p", 0), ("max_tokens", 0), ("stop", ["a"] * 5),
                         ("top_logprobs", 21), ("logit_bias", {"5": 101}), ("n", 2)]:
        bad = {**good, field: value}
        assert not validator.is_valid(bad), field
        r = server.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)


class RecordingBody(dict):
    """A request body that notes every field a handler looks up."""

    def __init__(self, body, seen: set):
        super().__init__(body)
        self.seen = seen

    def get(self, key, *default):
        self.seen.add(key)
        return super().get(key, *default)

    def __getitem__(self, key):
        self.seen.add(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self.seen.add(key)
        return super().__contains__(key)


@pytest.fixture(scope="module")
def app(server_model_dir):
    from appliance.config import Settings
    from appliance.server import create_app

    app = create_app({"settings": Settings(model=str(server_model_dir), max_context=256, sysfs_root="/nonexistent")})
    assert app.extensions["appliance"].ready_event.wait(60)
    yield app
    app.extensions["appliance"].close()


@pytest.mark.parametrize("path, body, table", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}, request_fields.CHAT),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}, request_fields.COMPLETION),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}]}, request_fields.TOKENIZE),
    ("/tokenize", {"prompt": "hi"}, request_fields.TOKENIZE),
    ("/detokenize", {"tokens": [1, 2]}, request_fields.DETOKENIZE),
])
def test_every_field_a_handler_reads_is_published(app, monkeypatch, path, body, table):
    from appliance.server import openai_api

    seen: set = set()
    monkeypatch.setattr(openai_api, "read_json_body", lambda: RecordingBody(body, seen))
    r = app.test_client().post(path, json=body)
    assert r.status_code == 200, r.json
    assert seen and seen <= set(table), sorted(seen - set(table))
    assert path in {route[1] for route in ROUTES}


def test_the_tables_publish_what_validation_enforces():
    """Scalar fields read themselves with the bounds they publish."""
    from appliance.server.errors import APIError

    f = request_fields.GENERATION["top_p"]
    assert f.schema(request_fields.ServedFacts())["anyOf"][0]["exclusiveMinimum"] == 0.0
    with pytest.raises(APIError) as e:
        f.read({"top_p": 0})
    assert e.value.param == "top_p"
    dims = request_fields.EMBEDDINGS["dimensions"]
    facts = request_fields.ServedFacts(embedding_size=32)
    assert dims.schema(facts)["anyOf"][0]["maximum"] == 32
    with pytest.raises(APIError):
        dims.read({"dimensions": 33}, facts=facts)
    assert dims.read({"dimensions": 32}, facts=facts) == 32
