"""The response objects of a chat reply with a thought and tool calls, streamed and not, read
back by the openai SDK's own stream accumulator (what `client.chat.completions.stream` uses)."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from appliance.server.chat import ToolChoice
from appliance.server.reply import Reply
from appliance.server.scheduler import Finished

PIECES = ["<think>", "\nI should", " call it.\n", "</think>", "\n\n", "Checking.", "\n<tool_call>",
          '\n{"name": "get_weather", "arguments": {"city": "Zü', 'rich"}}\n</tool_call>', "\n<tool_call>\n",
          '{"name": "read_board_sensor", "arguments": {"sensor": "soc"}}', "\n</tool", "_call>"]


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "x"


def gen(**kw):
    fields = dict(kind="chat", model="qwen3-tiny", prompt_ids=[1], params=None, stream=True, include_usage=False,
                  logprobs=False, top_logprobs=0, reasoning="allowed", tools=[{}],
                  tool_choice=ToolChoice("auto"), parallel_tool_calls=True)
    fields.update(kw)
    return SimpleNamespace(**fields)


def events(pieces):
    return [SimpleNamespace(text=t, token_id=i, logprob=None, top_logprobs=None) for i, t in enumerate(pieces)]


FIN = Finished("stop", "stop", "", 10, len(PIECES))


def test_non_streaming_message():
    reply = Reply(gen(stream=False), Tok(), {})
    for ev in events(PIECES):
        reply.add(ev)
    body = reply.body(FIN)
    choice = body["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    msg = choice["message"]
    assert msg["reasoning_content"] == "I should call it." and msg["content"] == "Checking.\n"
    calls = msg["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather", "read_board_sensor"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Zürich"}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert reply.tool_stats.parsed == 2 and reply.tool_stats.malformed == 0


def test_stream_reassembled_by_the_openai_sdk():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    reply = Reply(gen(), Tok(), {})
    chunks = [reply.first_chunk()] + [c for ev in events(PIECES) for c in reply.token_chunks(ev)]
    chunks += reply.finish_chunks(FIN)
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    final = state.get_final_completion()
    msg = final.choices[0].message
    assert final.choices[0].finish_reason == "tool_calls"
    assert [t.function.name for t in msg.tool_calls] == ["get_weather", "read_board_sensor"]
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Zürich"}
    assert msg.content == "Checking.\n"
    assert "".join(c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks) == "I should call it."
    # each call: index, id and name first, then its arguments
    deltas = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert [sorted(d) for d in deltas] == [["function", "id", "index", "type"], ["function", "index"]] * 2
    assert [d["index"] for d in deltas] == [0, 0, 1, 1]


@pytest.mark.parametrize("state, pieces, reasoning, content", [
    ("allowed", ["<think>\nhalf a thou", "ght"], "half a thought", ""),
    ("closed", ["plain answer"], None, "plain answer"),
])
def test_reasoning_field_when_cut_off_or_off(state, pieces, reasoning, content):
    reply = Reply(gen(stream=False, reasoning=state, tools=None), Tok(), {})
    for ev in events(pieces):
        reply.add(ev)
    msg = reply.body(Finished("length", "length", "", 1, 2))["choices"][0]["message"]
    assert msg["reasoning_content"] == reasoning and msg["content"] == content and "tool_calls" not in msg


def test_malformed_call_is_content_and_finish_stays_stop():
    reply = Reply(gen(stream=False, reasoning=None), Tok(), {})
    for ev in events(['<tool_call>\n{"name": "f", "arguments": {oops}}\n</tool_call>']):
        reply.add(ev)
    choice = reply.body(FIN)["choices"][0]
    assert choice["finish_reason"] == "stop" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith("<tool_call>") and reply.tool_stats.malformed == 1
