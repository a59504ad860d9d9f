"""The prefix cache through the real server and the openai SDK: cached_tokens in usage, the
metrics and /health that report it, and a restarted server serving the next turn from disk."""
from __future__ import annotations

import pytest

from live_server import start_server

SYSTEM = ("You are the assistant of an edge board. Edge boards run language models on their CPUs "
          "with int8 kernels. " * 6)


def chat(server, messages, max_tokens=8):
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    return client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)


def metric(server, name: str) -> float:
    return server.metrics().get((name, ()), 0.0)


@pytest.mark.slow
def test_cached_tokens_and_the_next_turn_after_a_restart(server_model_dir, tmp_path):
    kv_dir = tmp_path / "kv"
    args = ("--max-context", "1024", "--kv-cache-dir", str(kv_dir), "--grace-period", "2")
    first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello world! How are you today?"}]
    server = start_server(server_model_dir, *args)
    try:
        a = chat(server, first)
        b = chat(server, first)
        assert a.usage.prompt_tokens_details.cached_tokens == 0
        assert b.usage.prompt_tokens_details.cached_tokens == (b.usage.prompt_tokens - 1) // 32 * 32 > 0
        assert b.choices[0].message.content == a.choices[0].message.content
        assert metric(server, "appliance_prefix_cache_queries_total") == 2 * a.usage.prompt_tokens
        assert metric(server, "appliance_prefix_cache_hits_total") == b.usage.prompt_tokens_details.cached_tokens
        queue = server.wait_idle()
        assert queue["kv_tokens_total"] > 1024 and queue["prefix_cache"]["hit_ratio"] > 0
        turn2 = first + [{"role": "assistant", "content": a.choices[0].message.content},
                         {"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
        want = chat(server, turn2)
        assert want.usage.prompt_tokens_details.cached_tokens >= b.usage.prompt_tokens_details.cached_tokens
    finally:
        assert server.stop() == 0, server.log()[-2000:]
    assert "KV cache kept on disk" in server.log()
    restarted = start_server(server_model_dir, *args)
    try:
        got = chat(restarted, turn2)
        assert got.choices[0].message.content == want.choices[0].message.content
        assert got.usage.prompt_tokens_details.cached_tokens >= b.usage.prompt_tokens_details.cached_tokens
        assert metric(restarted, "appliance_prefix_cache_disk_hits_total") == got.usage.prompt_tokens_details.cached_tokens
        assert metric(restarted, "appliance_kv_disk_files") > 0
        assert sum(v for (name, _), v in restarted.metrics().items()
                   if name == "appliance_kv_disk_rejected_files_total") == 0
    finally:
        restarted.stop()
