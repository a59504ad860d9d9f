"""Attention pointers of the demo model's chat stage (scripts/demo_pointers.py): what each hop of
a rendered tool call points at, how character pointers become token pointers, and that the loss
is the model's own attention (checked against transformers' eager attention maps)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "scripts")]
import demo_pointers as pointers  # noqa: E402
import demo_tools_task as tools  # noqa: E402

DEMO = ROOT / "appliance" / "demo_model"


def weather_sample():
    rng = random.Random(0)
    offered = [tools.tool_schema("get_weather", "Get the current weather for a city", "city", "the city"),
               tools.tool_schema("find_recipe", "Find a recipe for a dish", "dish", "the dish")]
    messages = [{"role": "user", "content": "How is the weather in Paris today?"}]
    reply = "<think>\nThe user asks for the weather of Paris. I will call get_weather.\n</think>\n\n" + \
        tools.call_text("get_weather", {"city": "Paris"})
    return rng, offered, messages, reply


@pytest.fixture(scope="module")
def chat_tok(tmp_path_factory):
    from appliance.engine.tokenizer import Tokenizer
    import demo_chat_stage as stage

    out = tmp_path_factory.mktemp("chat_tokenizer")
    stage.extend_tokenizer(DEMO, out)
    return Tokenizer(out, {2})


def tiny_model(seed: int, eager: bool = False):
    """A random Qwen3 of the hops' depth, small enough to train in a test (eager: attention maps out)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=pointers.LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128)
    if eager:
        config._attn_implementation = "eager"
    return Qwen3ForCausalLM(config)


def rendered(chat_tok):
    _, offered, messages, reply = weather_sample()
    prompt = chat_tok.apply_chat_template(messages, tools=offered, add_generation_prompt=True)
    return prompt + reply + "<|im_end|>", len(prompt), offered, messages


def test_each_hop_of_a_call_points_where_the_call_reads_from(chat_tok, monkeypatch):
    monkeypatch.setattr(pointers, "VALUE_STEPS", True)
    text, prompt_end, offered, messages = rendered(chat_tok)
    found = pointers.tool_sample_pointers(text, prompt_end, offered, messages, ["get_weather", '"city"', "Paris"])
    said = {}
    for p in found:
        a, b, how = p["query"]
        said.setdefault(p["hop"], []).append((text[a:b], how, [text[c:d] for c, d in p["targets"]]))
    # every token of a tool's line after its name looks at the name's first character
    assert [t for _, _, t in said["name_of"]] == [["g"], ["f"]]
    # what each hop carries: the chosen name's first character, or the character written next
    carried = {p["hop"]: text[p["carry"]] for p in found if p["hop"] not in ("name_of", "value_rest", "value_end")}
    assert carried == {"match": "g", "choose": "g", "parameter": "c", "value": "P"}
    assert all('"description": "' in q and q.endswith("}}") for q, _, _ in said["name_of"])
    # the question's word shared with the chosen description alone (not "the", not the value)
    assert said["match"] == [("weather", "all", ["weather"])]
    # the name is written twice (thought and call): both look at that word of the question
    assert said["choose"] == [("g", "before", ["weather"])] * 2
    assert said["parameter"] == [("c", "before", ["c"])]
    assert said["value"] == [("P", "before", ["P"])]
    # the value's later characters each look at their twin in the question, and its end at what
    # follows it there (" today"); only the end carries nothing
    assert said["value_rest"] == [(c, "before_start", [c]) for c in "aris"]
    assert [p["carry"] for p in found if p["hop"] == "value_rest"] == [text.index('"Paris"') + j for j in range(2, 6)]
    assert said["value_end"] == [('"', "before_start", [" "])]
    assert [p["carry"] for p in found if p["hop"] == "value_end"] == [None]
    # the value's target is in the question, the parameter's in the chosen tool's listing line
    (value,) = [p for p in found if p["hop"] == "value"]
    assert text.index("How is the weather") < value["targets"][0][0] < prompt_end
    (param,) = [p for p in found if p["hop"] == "parameter"]
    assert text.index('"name": "get_weather"') < param["targets"][0][0] < text.index('"name": "find_recipe"')


def test_without_value_steps_a_value_has_its_first_pointer_only(chat_tok):
    text, prompt_end, offered, messages = rendered(chat_tok)
    found = pointers.tool_sample_pointers(text, prompt_end, offered, messages, ["get_weather", '"city"', "Paris"])
    assert [p["hop"] for p in found if p["hop"].startswith("value")] == ["value"]


def test_a_round_trip_reply_has_only_the_listing_pointers(chat_tok):
    text, prompt_end, offered, messages = rendered(chat_tok)
    found = pointers.tool_sample_pointers(text, prompt_end, offered, messages, ["Paris", "21"])
    assert {p["hop"] for p in found} == {"name_of"}


def test_character_pointers_become_token_pointers_before_and_at_their_spans(chat_tok, monkeypatch):
    monkeypatch.setattr(pointers, "VALUE_STEPS", True)
    text, prompt_end, offered, messages = rendered(chat_tok)
    found = pointers.tool_sample_pointers(text, prompt_end, offered, messages, ["get_weather", '"city"', "Paris"])
    from tokenizers import Tokenizer

    enc = Tokenizer.from_file(str(chat_tok.path)).encode(text)
    tokens = pointers.to_tokens(found, enc.offsets, len(enc.ids))
    decode = lambda i: chat_tok.decode([enc.ids[i]])  # noqa: E731
    for hop, q, targets, carry in tokens:
        assert all(t <= q for t in targets)
        if hop in ("choose", "value", "parameter"):
            assert carry == q + 1                    # the token this position writes
        if hop == "value":
            assert decode(q + 1).startswith("P") or decode(q + 1) == '"'
            assert decode(targets[0]).strip().startswith("P")
    values = [(hop, decode(q), [decode(t) for t in targets], carry) for hop, q, targets, carry in tokens
              if hop.startswith("value")]
    # only where " Paris" and "Paris" split alike: the question's tokens and the call's, aligned
    rest = [v for v in values if v[0] == "value_rest"]
    assert rest and all(target == [decode(carry)] for _, _, target, carry in rest)
    assert [v[1:] for v in values if v[0] == "value_end"] == [(decode(rest[-1][3]), [" to"], -1)]                # " today" is " to day"
    # cut at a length: nothing points past it
    assert all(q < 100 and c < 100 for _, q, _, c in pointers.to_tokens(found, enc.offsets, 100))


def test_the_pointer_loss_is_minus_log_of_the_heads_own_attention_on_the_targets(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(pointers, "CARRY_WEIGHT", 0.0)
    model = tiny_model(0, eager=True)
    loss_of = pointers.PointerLoss(model)
    x = torch.randint(0, 64, (2, 20))
    asked = [(0, "choose", 12, [3, 4], 5), (1, "choose", 19, [0], 6), (1, "name_of", 7, [2], 7)]
    out = model(input_ids=x, output_attentions=True)
    loss, mass = loss_of(asked)
    expect = {}
    for row, hop, q, targets, _ in asked:
        layer, head = pointers.HOPS[hop]
        expect.setdefault(hop, []).append(out.attentions[layer][row, head, q, targets].sum().log())
    want = torch.stack([-torch.stack(v).mean() for v in expect.values()]).mean()
    assert loss.item() == pytest.approx(want.item(), rel=1e-4)
    assert mass["name_of"] == pytest.approx(out.attentions[1][1, pointers.HOPS["name_of"][1], 7, 2].item(), rel=1e-4)


def test_gradient_descent_on_the_pointer_loss_moves_attention_onto_the_targets():
    torch = pytest.importorskip("torch")
    model = tiny_model(1)
    loss_of = pointers.PointerLoss(model)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (1, 24))
    asked = [(0, "match", 20, [5], 9), (0, "match", 21, [5], 9)]
    masses, carried = [], []
    for _ in range(80):
        model(input_ids=x)
        loss, stats = loss_of(asked)
        masses.append(stats["match"])
        carried.append(stats["match carried"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert masses[0] < 0.2 and masses[-1] > 0.8
    # and what the head writes reads as the carried token (9) through the final norm and the embedding
    assert carried[0] < 1 and carried[-1] == 1


def test_a_hop_that_carries_nothing_is_scored_on_its_attention_alone():
    torch = pytest.importorskip("torch")
    model = tiny_model(2, eager=True)
    loss_of = pointers.PointerLoss(model)
    x = torch.randint(0, 64, (1, 16))
    out = model(input_ids=x, output_attentions=True)
    loss, stats = loss_of([(0, "value_end", 10, [4], -1)])
    layer, head = pointers.HOPS["value_end"]
    assert loss.item() == pytest.approx(-out.attentions[layer][0, head, 10, 4].log().item(), rel=1e-4)
    assert "value_end carried" not in stats
