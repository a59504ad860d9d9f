"""appliance/server/chat.py on its own: what a chat request becomes before the engine sees it."""
from __future__ import annotations

from appliance.server.chat import without_calls
from appliance.server.tool_calls import START as CALL_TAG

TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


class Vocab:
    def __init__(self, tokens):
        self.ids = {t: i for i, t in enumerate(tokens)}

    def token_to_id(self, token):
        return self.ids.get(token)


QWEN3 = Vocab(["<|im_end|>", "<think>", "</think>", CALL_TAG, "</tool_call>"])


def test_with_no_tool_offered_a_call_cannot_start():
    assert without_calls(QWEN3, None, None) == {3: -100.0}
    assert without_calls(QWEN3, None, {7: 5.0}) == {7: 5.0, 3: -100.0}


def test_offered_tools_leave_the_bias_as_the_request_sent_it():
    assert without_calls(QWEN3, [TOOL], None) is None
    assert without_calls(QWEN3, [TOOL], {7: 5.0}) == {7: 5.0}


def test_the_requests_own_bias_on_the_tag_wins():
    assert without_calls(QWEN3, None, {3: 10.0}) == {3: 10.0}


def test_a_model_without_the_tag_is_left_alone():
    assert without_calls(Vocab(["<|im_end|>"]), None, None) is None
