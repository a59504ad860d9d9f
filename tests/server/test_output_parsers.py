"""The reasoning and tool-call parsers of a reply's text: every way the text can be split into
stream chunks gives what the whole text gives, and odd answers (nested braces, tags inside
strings, unicode, malformed JSON) come out as clients expect."""
from __future__ import annotations

import json

import pytest

from appliance.server.reasoning import ReasoningParser, split_reasoning
from appliance.server.reply import OutputParser
from appliance.server.tool_calls import ToolCallParser

THOUGHT = "<think>\nThe user wants the weather.\nI will call the tool.\n</think>\n\n"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich", "unit": "celsius"}}\n</tool_call>'
# A recorded Qwen3 reply with a thought, a sentence and two calls, as its tokens decoded one by one.
RECORDED = [
    "<think>", "\n", "The", " user", " wants", " the", " weather", ".\n", "I", " will", " call", " the", " tool",
    ".\n", "</think>", "\n\n", "Let", " me", " check", ".\n", "<tool_call>", "\n", '{"', "name", '":', ' "',
    "get", "_weather", '",', ' "', "arguments", '":', ' {"', "city", '":', ' "', "Zü", "rich", '"}}', "\n",
    "</tool_call>", "\n", "<tool_call>", "\n", '{"name": "read_board_sensor", "arguments": {"sensor": "soc"}}',
    "\n", "</tool_call>"]


def run(parser_factory, pieces, finish=lambda p: p.finish()):
    parser = parser_factory()
    items = []
    for piece in pieces:
        items += parser.feed(piece)
    return merge(items + finish(parser))


def merge(items):
    """Adjacent text items of one kind joined (chunking may split them differently)."""
    out = []
    for kind, value in items:
        if out and kind != "tool_call" and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + value)
        else:
            out.append((kind, value))
    return [(k, (v.name, json.loads(v.arguments)) if k == "tool_call" else v) for k, v in out]


def every_split(text):
    """The text in two pieces at every position, and one character at a time."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


def reply_parser():
    return OutputParser("allowed", tools=True, parallel=True)


EXPECTED = [("reasoning", "The user wants the weather.\nI will call the tool."), ("content", "Let me check.\n"),
            ("tool_call", ("get_weather", {"city": "Zürich"})),
            ("tool_call", ("read_board_sensor", {"sensor": "soc"}))]


def test_recorded_stream_token_by_token():
    assert run(reply_parser, RECORDED) == EXPECTED


def test_recorded_stream_at_every_chunk_boundary():
    """Adjacent tokens merged into one chunk at every boundary, and the text cut at every character."""
    text = "".join(RECORDED)
    for i in range(1, len(RECORDED)):
        pieces = RECORDED[:i - 1] + [RECORDED[i - 1] + RECORDED[i]] + RECORDED[i + 1:]
        assert run(reply_parser, pieces) == EXPECTED, i
    for pieces in every_split(text):
        assert run(reply_parser, pieces) == EXPECTED, pieces[:2]


@pytest.mark.parametrize("text, state, want", [
    (THOUGHT + "Hello.", "allowed", ("The user wants the weather.\nI will call the tool.", "Hello.")),
    ("Hello, no thought.", "allowed", (None, "Hello, no thought.")),
    ("Thinking already open.\n</think>\n\nAnswer.", "open", ("Thinking already open.", "Answer.")),
    ("<think>\ncut off in the middle of the thou", "allowed", ("cut off in the middle of the thou", "")),
    ("<think>\n\n</think>\n\nShort.", "allowed", ("", "Short.")),
    ("<think>\nnewlines\n\ninside stay\n</think>\n\nA\n\nB", "allowed", ("newlines\n\ninside stay", "A\n\nB")),
    ("no split <think> here", "closed", (None, "no split <think> here")),
    ("<thinking> is not the tag", "allowed", (None, "<thinking> is not the tag")),
    ("<think>\nПривет 🌍\n</think>\n\nÜber", "allowed", ("Привет 🌍", "Über")),
])
def test_reasoning_split(text, state, want):
    assert split_reasoning(text, state) == want
    for pieces in every_split(text):
        got = run(lambda: ReasoningParser(state), pieces)
        reasoning = "".join(v for k, v in got if k == "reasoning")
        content = "".join(v for k, v in got if k == "content")
        assert (reasoning if want[0] is not None else None, content) == want, pieces[:2]


def test_reasoning_never_lands_in_content_at_a_tag_boundary():
    parser = ReasoningParser("allowed")
    out = parser.feed("<think>\nabc</th") + parser.feed("ink>\n\nanswer")
    assert [k for k, _ in out] == ["reasoning", "content"] and out[-1][1] == "answer"


@pytest.mark.parametrize("body, want", [
    ('{"name": "f", "arguments": {"a": {"b": [1, {"c": "}"}]}}}', ("f", {"a": {"b": [1, {"c": "}"}]}})),
    ('{"name": "note", "arguments": {"text": "a </tool_call> inside a string"}}',
     ("note", {"text": "a </tool_call> inside a string"})),
    ('{"name": "say", "arguments": {"text": "quote \\" and brace { in a string"}}',
     ("say", {"text": 'quote " and brace { in a string'})),
    ('{"name": "ünïcode_名前", "arguments": {"città": "Zürich 🌧"}}', ("ünïcode_名前", {"città": "Zürich 🌧"})),
    ('{"name": "f", "arguments": "{\\"x\\": 1}"}', ("f", {"x": 1})),
    ('{"name": "f"}', ("f", {})),
])
def test_tool_call_bodies(body, want):
    text = f"<tool_call>\n{body}\n</tool_call>"
    for pieces in every_split(text):
        assert run(ToolCallParser, pieces) == [("tool_call", want)], pieces[:2]


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"a": 1,}}',          # trailing comma
    '{"arguments": {"a": 1}}',                        # no name
    '{"name": "f", "arguments": [1, 2]}',             # arguments not an object
    'get_weather(city="Paris")',                      # not JSON at all
    '{"name": "f", "arguments": {"a": 1}}}',          # one brace too many
])
def test_malformed_call_comes_back_as_content_and_is_counted(body):
    text = f"Sure.\n<tool_call>\n{body}\n</tool_call>"
    for pieces in every_split(text):
        parser = ToolCallParser()
        items = [i for p in pieces for i in parser.feed(p)] + parser.finish()
        assert merge(items) == [("content", text)], pieces[:2]
        assert parser.stats.malformed == 1 and parser.stats.parsed == 0


def test_unfinished_call_is_content():
    parser = ToolCallParser()
    items = parser.feed('<tool_call>\n{"name": "f", "argu') + parser.finish(cut_off=True)
    assert merge(items) == [("content", '<tool_call>\n{"name": "f", "argu')]
    assert parser.stats.malformed == 0
    parser = ToolCallParser()
    parser.feed('<tool_call>\n{"name": "f"')
    parser.finish(cut_off=False)                    # the model ended inside its call: malformed
    assert parser.stats.malformed == 1


def test_text_that_only_looks_like_a_tag_streams_through():
    assert run(ToolCallParser, ["a <tool", "_cal", "l-like thing"]) == [("content", "a <tool_call-like thing")]
    assert run(ToolCallParser, ["ends with <tool_c"]) == [("content", "ends with <tool_c")]


def test_one_call_when_parallel_calls_are_off():
    text = CALL + "\n" + CALL.replace("get_weather", "other")
    assert [k for k, _ in run(lambda: ToolCallParser(parallel=False), [text])] == ["tool_call"]


def test_reasoning_is_not_searched_for_calls():
    parser = OutputParser("allowed", tools=True, parallel=True)
    items = parser.feed("<think>\nI could write " + CALL + " here.\n</think>\n\nNo call.") + parser.finish(False)
    assert [k for k, _ in merge(items)] == ["reasoning", "content"]
