"""Qwen3's own chat template renders through our sandboxed Jinja exactly as through transformers'
apply_chat_template, for the conversations clients send (tests/chat_conversations.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from appliance.engine.tokenizer import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from chat_conversations import CONVERSATIONS  # noqa: E402
from tiny_models_chat import build_qwen3_chat  # noqa: E402


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> Path:
    return build_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat"))


@pytest.fixture(scope="module")
def both(chat_model_dir):
    from transformers import AutoTokenizer
    return Tokenizer(chat_model_dir), AutoTokenizer.from_pretrained(chat_model_dir)


@pytest.mark.parametrize("name, messages, tools, kwargs", CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_renders_as_transformers(both, name, messages, tools, kwargs, add_generation_prompt):
    ours, theirs = both
    want = theirs.apply_chat_template(messages, tools=tools, tokenize=False,
                                      add_generation_prompt=add_generation_prompt, **kwargs)
    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tools=tools, **kwargs)
    assert got == want
    assert ours.encode(got) == theirs(want, add_special_tokens=False)["input_ids"]


def test_thinking_switch_and_tags(both):
    ours, _ = both
    msgs = [{"role": "user", "content": "Hi"}]
    assert ours.apply_chat_template(msgs).endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(msgs, enable_thinking=False).endswith("<think>\n\n</think>\n\n")
    start, end = ours.think_token_ids
    assert ours.decode([start, end]) == "<think></think>"        # tags are text, not skipped specials


def test_tools_are_rendered_as_json(both):
    ours, _ = both
    tools = CONVERSATIONS[5][2]
    text = ours.apply_chat_template(CONVERSATIONS[5][1], tools=tools)
    assert '"name": "get_weather"' in text and "<tools>" in text and "</tools>" in text
