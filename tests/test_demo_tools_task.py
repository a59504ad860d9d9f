"""The demo model's chat-stage data (tests/demo_tools_task.py, scripts/demo_chat_stage.py): the
held-out tools stay out of training, the measure accepts exactly the right call, and the loss
spans of a rendered sample cover what they say they cover."""
from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]
import demo_tools_task as tools  # noqa: E402
import demo_chat_stage as stage  # noqa: E402
import train_demo_model  # noqa: E402

DEMO = ROOT / "appliance" / "demo_model"


def test_training_never_offers_a_held_out_name_or_parameter():
    rng = random.Random(0)
    held_values = {v.lower() for t in tools.HELD_OUT_TOOLS for v in t[5]}
    for i in range(3000):
        t = tools.training_tool(rng) if i % 2 else tools.action_tool(rng)
        assert t["name"] not in tools.HELD_OUT_NAMES
        assert t["parameter"] not in tools.HELD_OUT_PARAMETERS
        assert tools.made_up_value(rng).lower() not in held_values


def test_no_training_question_or_tool_uses_a_held_out_word():
    """Topics, parameters, values and name parts of the held-out tools (their verbs aside, which
    training's lookups share: get, read, find, check) never reach a training sample."""
    held = tools.HELD_OUT_WORDS - set(tools.VERBS) - {"to"}
    rng = random.Random(1)
    for _ in range(2000):
        messages, schemas, reply, _, picked = tools.tool_sample(rng)
        text = json.dumps(schemas) + " ".join(m["content"] or "" for m in messages if m["role"] != "system") + reply
        words = {w.lower() for w in re.findall(r"[A-Za-z]+", text)}
        assert not words & held, (words & held, text)


def test_piece_values_are_letters_of_the_vocabulary_and_never_a_held_out_value(monkeypatch):
    from tokenizers import Tokenizer

    monkeypatch.setattr(tools, "VALUE_PIECES", [])
    vocab = Tokenizer.from_file(str(DEMO / "tokenizer.json")).get_vocab()
    assert tools.widen_values(vocab) > 1000
    assert all(p.isalpha() and p.isascii() and not p.startswith("\u0120") for p in tools.VALUE_PIECES)
    assert "paris" not in tools.VALUE_PIECES and "soc" not in tools.VALUE_PIECES
    rng = random.Random(2)
    values = [tools.piece_value(rng) for _ in range(500)]
    assert all(v[:-1].isalpha() and 1 <= len(v) <= 3 * 8 + 1 for v in values)
    assert len(set(values)) > 450                   # nothing to remember, only to copy
    # the value a sample trains on is the one its question asks about
    messages, _, reply, _, picked = tools.tool_sample(random.Random(4))
    assert picked[-1] in messages[-1]["content"] or picked[0] in messages[-1]["content"]


def test_the_measure_takes_the_right_call_and_nothing_else():
    case = tools.held_out_cases()[0]
    right = tools.call_text(case["name"], {case["parameter"]: case["value"]})
    assert tools.is_right_call(right, case)
    assert tools.is_right_call("<think>\nI call it.\n</think>\n\n" + right, case)
    other = next(t["function"]["name"] for t in case["tools"] if t["function"]["name"] != case["name"])
    assert not tools.is_right_call(tools.call_text(other, {case["parameter"]: case["value"]}), case)
    assert not tools.is_right_call(tools.call_text(case["name"], {case["parameter"]: "elsewhere"}), case)
    assert not tools.is_right_call(right + "\n" + right, case)                     # one call, not two
    assert not tools.is_right_call(right.replace('"arguments"', "arguments"), case)  # not JSON


def test_held_out_cases_offer_three_tools_with_the_right_one_among_them():
    cases = tools.held_out_cases()
    assert len(cases) == 30
    for case in cases:
        names = [t["function"]["name"] for t in case["tools"]]
        assert len(set(names)) == 3 and case["name"] in names
        assert case["value"] in case["messages"][-1]["content"]


def test_round_trip_cases_follow_the_right_call_with_a_result_the_measure_looks_for():
    cases = tools.round_trip_cases()
    assert len(cases) == 30
    for case, asked in zip(cases, tools.held_out_cases()):
        user, assistant, tool = case["messages"]
        call = assistant["tool_calls"][0]
        assert user == asked["messages"][0] and call["function"]["name"] == asked["name"]
        assert json.loads(call["function"]["arguments"]) == {asked["parameter"]: asked["value"]}
        assert tool["tool_call_id"] == call["id"] and case["result"] in tool["content"]
        assert not set(json.loads(tool["content"])) & set(tools.RESULT_KEYS)   # keys training never used
    case = cases[0]
    r = case["result"]
    assert tools.answers_with_result(f"The answer is {r}.", case)
    assert tools.answers_with_result(f"<think>\nIt says {r}.\n</think>\n\nIt is {r}.", case)
    assert not tools.answers_with_result(f"<think>\nIt says {r}.\n</think>\n\nIt is warm.", case)
    assert not tools.answers_with_result(f"It is {r}3.", case)                   # a longer number
    assert not tools.answers_with_result(tools.call_text("again", {"x": r}), case)   # another call


def test_training_style_cases_are_calls_the_measure_accepts():
    for case in stage.training_style_cases(tools, 30, seed=3):
        assert case["name"] in [t["function"]["name"] for t in case["tools"]]
        assert tools.is_right_call(tools.call_text(case["name"], {case["parameter"]: case["value"]}), case)


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from appliance.engine.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("chat_tokenizer")
    tok = stage.extend_tokenizer(DEMO, out)
    base = train_demo_model.Data(tok, [("json.dumps", "Serialize obj to a JSON formatted str. " * 4)], [],
                                 random.Random(0))
    return stage.ChatData(base, Tokenizer(out, {2}), tools, None, random.Random(5))


def test_a_rendered_tool_sample_marks_its_reply_its_values_and_the_descriptions(chat_data):
    messages, schemas, reply, kwargs, values = tools.tool_sample(random.Random(8))
    text, spans = chat_data.render(messages, reply, schemas, kwargs, values)
    marked = {k: [text[a:b] for a, b, kind in spans if kind == k] for k in ("ans", "value", "lm")}
    assert marked["ans"] == [reply + stage.END_OF_TURN]
    assert all(v in reply for v in marked["value"]) and marked["value"]
    described = [t["function"]["description"] for t in schemas] + \
        [p["description"] for t in schemas for p in t["function"]["parameters"]["properties"].values()]
    assert sorted(marked["lm"]) == sorted(described)
    # the descriptions are in the prompt the template wrote, before the reply
    reply_at = text.rindex(reply)
    assert all(b <= reply_at for a, b, kind in spans if kind == "lm")


def test_a_tool_drill_row_is_a_listing_then_calls_with_their_values_marked(chat_data):
    ids, kinds, pointers = chat_data.tool_drill(512)
    assert len(ids) == len(kinds) <= 512
    assert {1, 2, 3} <= set(kinds)          # descriptions, replies, and the values inside them
    text = chat_data.chat_tok.decode(ids)
    listing = text[text.index("<tools>") + len("<tools>"):text.index("</tools>")]
    offered = [json.loads(line)["function"]["name"] for line in listing.strip().splitlines()]
    called = [json.loads(c)["name"] for c in tools.call_bodies(text)]
    assert called and set(called) <= set(offered)


def test_a_reply_is_tokenized_apart_from_its_prompt_as_a_served_prompt_ends(chat_data):
    """A quote after thinking-off's empty thought: the prompt's last piece is `ĊĊ`, as the
    server tokenizes the prompt alone, not `Ċ Ċ` as the whole text would split."""
    tok = chat_data.chat_tok
    ids, kinds, _ = chat_data.quote(512)
    served = tok.encode(tok.apply_chat_template([{"role": "user", "content": "x"}], enable_thinking=False))
    assert tok.id_to_token(served[-1]) == "\u010a\u010a"
    starts = [i for i, k in enumerate(kinds) if k == 4]
    assert starts and all(tok.id_to_token(ids[i - 1]) == "\u010a\u010a" and
                          tok.id_to_token(ids[i - 2]) == "</think>" for i in starts[:-1] if i < len(ids) - 1)
