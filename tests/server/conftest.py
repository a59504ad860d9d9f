"""A real gunicorn server on the tiny model, shared by the server tests.

`server` starts `python -m appliance serve` (the same launcher as `appliance serve`)
once per session on a free loopback port, with a fake RK3588 sysfs tree, and stops
it with SIGTERM at the end. Every test waits for the server to be idle first, so a
test that left streams behind cannot disturb the next one.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from live_server import ARTIFACTS, LiveServer, serving  # noqa: E402
from tiny_models_chat import build_qwen3_chat  # noqa: E402


@pytest.fixture(scope="session")
def server_model_dir(tiny_qwen3_dir) -> Path:
    return tiny_qwen3_dir


@pytest.fixture(scope="session")
def server(server_model_dir):
    with serving(server_model_dir, "--max-batch", "4", "--max-queue", "4", "--max-context", "2048",
                 "--kv-cache-tokens", "16384", "--request-timeout", "60", "--max-body-bytes", "65536",
                 "--grace-period", "3") as srv:
        yield srv


@pytest.fixture(scope="session")
def qwen3_chat_dir(tmp_path_factory) -> Path:
    """A tiny random checkpoint with Qwen3's chat template, thought and tool-call tags."""
    return build_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat"))


@pytest.fixture(scope="session")
def chat_server(qwen3_chat_dir):
    """A server on it, also answering to a client's hard-coded model name."""
    with serving(qwen3_chat_dir, "--max-batch", "4", "--max-queue", "4", "--max-context", "2048",
                 "--request-timeout", "60", "--served-model-name", "qwen3-tiny,gpt-4o-mini") as srv:
        yield srv


@pytest.fixture
def chat_client(chat_server):
    from openai import OpenAI

    chat_server.wait_idle()
    return OpenAI(base_url=chat_server.base + "/v1", api_key="not-needed", max_retries=0, timeout=60)


@pytest.fixture
def idle_server(server) -> LiveServer:
    server.wait_idle()
    return server


@pytest.fixture(scope="session")
def model_id(server) -> str:
    return server.get("/v1/models").json()["data"][0]["id"]


@pytest.fixture
def openai_client(idle_server):
    from openai import OpenAI

    return OpenAI(base_url=idle_server.base + "/v1", api_key="not-needed", max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
