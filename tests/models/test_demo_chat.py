"""The demo model in Qwen3's chat format, as clients use it: it calls the tool a question needs
(name and parameter read off tools it never saw in training, the value copied from the question),
thinks before it answers when thinking is on, and does both through the server for the openai
SDK (streaming or not) and LangChain.

The held-out set (tests/demo_tools_task.py): 30 prompts, 10 unseen functions x 3 questions, each
offered beside two other unseen tools. A call counts when it is the only one, names the right
function and passes the question's value (is_right_call). "Served" is what a client gets: the
server's tool-call grammar holds a started call to the offered names and their parameters
(tool_choice auto). APPLIANCE_DEMO_MODEL points the tests at another export of the chat stage.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import requests

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "server")]
import demo_tools_task as tools  # noqa: E402
from live_server import serving  # noqa: E402

MODEL = Path(os.environ["APPLIANCE_DEMO_MODEL"]) if os.environ.get("APPLIANCE_DEMO_MODEL") else None
# Floors for held-out calls as served, a few cases under what the shipped model reached here (24 of 30
# thinking off, 21 of 30 on; x86 CPUs with other kernels may flip a case): a broken template, grammar or
# parser gives 0. The bar the demo model is trained toward is 0.8 (scripts/demo_chat_stage.py).
SERVED_FLOOR = 0.7
THINKING_FLOOR = 0.6
# the same prompts after the right call and its result (25 of 30 answered with it as shipped)
ROUND_TRIP_FLOOR = 0.7
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
WEATHER = tools.tool_schema("get_weather", "Get the current weather for a city", "city", "the city")
RECIPE = tools.tool_schema("find_recipe", "Find a recipe for a dish", "dish", "the dish")


@pytest.fixture(scope="module")
def server():
    with serving(MODEL, "--served-model-name", "demo") as srv:     # the name clients are given
        yield srv


def chat(server, messages, tools_offered=None, thinking=False, max_tokens=64, **extra):
    body = {"messages": messages, "temperature": 0, "max_tokens": max_tokens,
            "chat_template_kwargs": {"enable_thinking": thinking}, **extra}
    if tools_offered:
        body["tools"] = tools_offered
    r = requests.post(server.base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def as_text(choice) -> str:
    """A served reply in the model's own call syntax, for the held-out measure."""
    calls = choice["message"].get("tool_calls") or []
    return "".join(tools.call_text(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls)


def served_share(server, thinking: bool) -> tuple[float, list]:
    hits, replies = 0, []
    for case in tools.held_out_cases():
        choice = chat(server, case["messages"], case["tools"], thinking=thinking, max_tokens=160 if thinking else 64)
        replies.append((case["messages"][-1]["content"], choice["message"]))
        hits += tools.is_right_call(as_text(choice), case)
    return hits / 30, replies


def test_held_out_tool_calls_as_served_thinking_off(server):
    share, replies = served_share(server, thinking=False)
    print(f"held-out tool calls as served, thinking off: {share:.2f}")
    assert share >= SERVED_FLOOR, replies


def test_held_out_tool_calls_as_served_thinking_on_with_the_reasoning_split_out(server):
    share, replies = served_share(server, thinking=True)
    print(f"held-out tool calls as served, thinking on: {share:.2f}")
    assert share >= THINKING_FLOOR, replies
    thought = [m for _, m in replies if m.get("reasoning_content")]
    assert len(thought) >= 0.8 * len(replies)              # the model thinks first when thinking is on
    assert all("<think>" not in (m.get("content") or "") for _, m in replies)


def test_held_out_round_trips_as_served_answer_with_the_result(server):
    hits, replies = 0, []
    for case in tools.round_trip_cases():
        choice = chat(server, case["messages"], case["tools"], max_tokens=48)
        content = choice["message"].get("content") or ""
        replies.append((case["result"], content))
        hits += not choice["message"].get("tool_calls") and tools.answers_with_result(content, case)
    assert hits / 30 >= ROUND_TRIP_FLOOR, replies


def test_a_tool_round_trip_with_the_openai_sdk(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "How is the weather in Berlin today?"}]
    first = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER, RECIPE],
                                           temperature=0, max_tokens=64, extra_body=NO_THINKING).choices[0]
    assert first.finish_reason == "tool_calls"
    (call,) = first.message.tool_calls
    assert call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Berlin"}
    messages += [first.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Berlin", "celsius": 21})}]
    answer = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER, RECIPE],
                                            temperature=0, max_tokens=64, extra_body=NO_THINKING).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "21" in answer.message.content                  # the answer uses the tool's result


def test_a_streamed_tool_call_is_reassembled_by_the_sdk(server):
    from openai import OpenAI

    client = OpenAI(base_url=server.base + "/v1", api_key="unused", max_retries=0)
    with client.beta.chat.completions.stream(
            model="demo", messages=[{"role": "user", "content": "Find a recipe for risotto."}],
            tools=[WEATHER, RECIPE], temperature=0, max_tokens=64, extra_body=NO_THINKING) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    (call,) = final.message.tool_calls
    assert call.function.name == "find_recipe" and json.loads(call.function.arguments) == {"dish": "risotto"}


def test_langchain_gets_the_tool_call(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city"""
        return "21 degrees"

    llm = ChatOpenAI(base_url=server.base + "/v1", api_key="unused", model="demo", temperature=0, max_tokens=64,
                     max_retries=0, timeout=60)
    msg = llm.bind_tools([get_weather]).invoke("What is the weather in Berlin?", extra_body=NO_THINKING)
    assert [(c["name"], c["args"]) for c in msg.tool_calls] == [("get_weather", {"city": "Berlin"})]


def test_no_tool_offered_gets_an_answer_not_a_call(server):
    choice = chat(server, [{"role": "user", "content": "What does json.dumps do?"}])
    assert choice["finish_reason"] in ("stop", "length") and not choice["message"].get("tool_calls")
    assert choice["message"]["content"].strip() and "<tool_call>" not in choice["message"]["content"]
