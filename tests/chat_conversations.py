"""Conversations as OpenAI clients send them, with what Qwen3's template must handle: a system
prompt, thinking on and off, earlier reasoning (as a field and inline), tool definitions,
assistant tool calls with null content, several tool responses in a row.

Each case: (name, messages, tools or None, chat_template_kwargs).
"""
from __future__ import annotations

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city"]}}}
SENSOR = {"type": "function", "function": {
    "name": "read_board_sensor", "description": "Read one sensor of the board",
    "parameters": {"type": "object", "properties": {"sensor": {"type": "string"}}, "required": ["sensor"]}}}
TOOLS = [WEATHER, SENSOR]

CALL_PARIS = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
CALL_SOC = {"id": "call_2", "type": "function",
            "function": {"name": "read_board_sensor", "arguments": '{"sensor": "soc"}'}}

SYSTEM = {"role": "system", "content": "You are a helpful assistant on an edge board."}
ASK = {"role": "user", "content": "What is the weather in Paris, and how warm is the board?"}

CONVERSATIONS = [
    ("system prompt", [SYSTEM, {"role": "user", "content": "Hello!"}], None, {}),
    ("thinking off", [SYSTEM, {"role": "user", "content": "Hello!"}], None, {"enable_thinking": False}),
    ("thinking on", [{"role": "user", "content": "Hello!"}], None, {"enable_thinking": True}),
    ("earlier reasoning as a field", [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "4.", "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "And 3 + 3?"}], None, {}),
    ("earlier reasoning inline", [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "<think>\nTwo and two make four.\n</think>\n\n4."},
        {"role": "user", "content": "And 3 + 3?"}], None, {}),
    ("tool definitions", [SYSTEM, ASK], TOOLS, {}),
    ("tool definitions, thinking off", [ASK], TOOLS, {"enable_thinking": False}),
    ("assistant tool calls and several tool responses", [
        SYSTEM, ASK,
        {"role": "assistant", "content": "", "tool_calls": [CALL_PARIS, CALL_SOC]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"temp_c": 18}'},
        {"role": "tool", "tool_call_id": "call_2", "name": "read_board_sensor", "content": '{"celsius": 47.5}'},
    ], TOOLS, {}),
    ("a tool round trip with reasoning, then a new question", [
        ASK,
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "I need the weather tool.",
         "tool_calls": [CALL_PARIS]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": "It is 18 degrees in Paris."},
        {"role": "user", "content": "Thanks. And the board?"},
    ], TOOLS, {"enable_thinking": False}),
]
