"""The chat stage's own arithmetic (scripts/demo_chat_stage.py): the twin-embedding loss that lines
up bare and space-led letter pieces, and the choice of the checkpoint to ship."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import demo_chat_stage as stage  # noqa: E402


def test_twin_pairs_are_letter_pieces_with_a_space_led_twin():
    vocab = {"Par": 0, "\u0120Par": 1, "is": 2, "\u0120is": 3, "ather": 4, "_": 5, "\u0120_": 6, "ab1": 7, "\u0120ab1": 8}
    plain, spaced = stage.twin_pairs(vocab)
    assert sorted(zip(plain, spaced)) == [(0, 1), (2, 3)]


def test_twin_loss_is_zero_for_one_shared_offset_and_grows_with_the_spread():
    gen = torch.Generator().manual_seed(0)
    spaced_rows = torch.randn(10, 16, generator=gen)
    offset = torch.randn(16, generator=gen)
    plain, spaced = torch.arange(10, 20), torch.arange(10)
    aligned = torch.cat([spaced_rows, spaced_rows + offset])
    assert stage.twin_loss(aligned, plain, spaced).item() == pytest.approx(0.0, abs=1e-6)
    noise = torch.randn(10, 16, generator=gen)
    losses = [stage.twin_loss(torch.cat([spaced_rows, spaced_rows + offset + s * noise]), plain, spaced).item()
              for s in (0.1, 0.5, 1.0)]
    assert 0 < losses[0] < losses[1] < losses[2]
    # the loss is relative to the embeddings' size: scaling everything leaves it unchanged
    scaled = torch.cat([spaced_rows, spaced_rows + offset + noise]) * 7.0
    assert stage.twin_loss(scaled, plain, spaced).item() == pytest.approx(losses[2], rel=1e-5)


def test_the_loss_pulls_twins_together_under_gradient_descent():
    gen = torch.Generator().manual_seed(1)
    weight = torch.nn.Parameter(torch.randn(40, 8, generator=gen))
    plain, spaced = torch.arange(20, 40), torch.arange(20)
    before = stage.twin_loss(weight, plain, spaced).item()
    opt = torch.optim.Adam([weight], lr=0.05)
    for _ in range(200):
        opt.zero_grad()
        stage.twin_loss(weight, plain, spaced).backward()
        opt.step()
    assert stage.twin_loss(weight, plain, spaced).item() < 0.05 * before


def test_keep_best_needs_the_recall_and_a_better_score(tmp_path):
    model = torch.nn.Linear(2, 2)
    best, lines = {"score": -1.0, "state": None, "step": 0, "path": tmp_path / "best.pt"}, []
    stage.keep_best(best, model, 10, 1.5, stage.KEEP_RECALL - 0.1, lines.append)
    assert best["state"] is None                               # lost retrieval: never shipped
    stage.keep_best(best, model, 20, 1.0, stage.KEEP_RECALL, lines.append)
    assert best["step"] == 20
    kept = best["state"]["weight"].clone()
    with torch.no_grad():
        model.weight.add_(1.0)                                 # the kept state is a copy, not the live tensor
    assert torch.equal(best["state"]["weight"], kept)
    stage.keep_best(best, model, 30, 0.9, 1.0, lines.append)  # worse calls: the earlier one stays
    assert best["step"] == 20
    stage.keep_best(best, model, 40, 1.2, 0.9, lines.append)
    assert best["step"] == 40 and len(lines) == 2
    saved = torch.load(best["path"], weights_only=False)      # on disk too, for a resumed run
    assert saved["step"] == 40 and torch.equal(saved["state"]["weight"], model.weight)


def test_a_best_checkpoint_scored_by_other_terms_is_kept_without_its_score(tmp_path):
    model, lines = torch.nn.Linear(2, 2), []
    path = tmp_path / "best.pt"
    assert stage.load_best(path, False, lines.append)["state"] is None         # none yet
    best = stage.load_best(path, False, lines.append)
    stage.keep_best(best, model, 20, 4.5, 1.0, lines.append)
    resumed = stage.load_best(path, False, lines.append)
    assert (resumed["score"], resumed["step"], resumed["path"]) == (4.5, 20, path)
    assert stage.load_best(path, True, lines.append)["state"] is None          # --fresh
    torch.save({"score": 4.0, "step": 10, "state": model.state_dict()}, path)  # before the round trips counted
    older = stage.load_best(path, False, lines.append)
    assert older["score"] == -1.0 and older["step"] == 10 and "other terms" in lines[-1]


class _Pools:
    """A small stand-in for demo_tools_task's pools, which the copy-heavy tasks draw from."""
    # Python keywords among the words, as the corpus has them: a function must never use one
    CORPUS_WORDS = ["ledger", "anchor", "bristle", "cobalt", "meadow", "quartz", "tundra", "willow", "zephyr",
                    "class", "import", "while", "return"]
    WORDS = CORPUS_WORDS

    @staticmethod
    def made_up_value(rng):
        return rng.choice(_Pools.CORPUS_WORDS)


def test_extraction_records_hold_every_value_they_name():
    import json
    import random
    for seed in range(50):
        text, fields = stage.extraction_record(random.Random(seed), _Pools)
        assert fields and all(str(v) in text for v in fields.values())
        assert json.loads(json.dumps(fields)) == fields      # the answer is the JSON of these fields
        assert all(isinstance(fields[k], int) for k in ("year", "price", "number", "count") if k in fields)


def test_small_functions_compile_and_have_a_variable_to_rename():
    import random
    import re
    for seed in range(50):
        code = stage.small_function(random.Random(seed), _Pools)
        compile(code, "<function>", "exec")
        assert re.findall(r"\b([a-z]{2,12})\b =", code)        # a variable code_edit can rename


def test_copy_cases_ask_for_what_they_answer():
    import json
    quote, rename, extract = stage.COPY_CASES
    assert quote[1] in quote[0]
    assert rename[1] == rename[0].split("\n\n", 1)[1].replace("count", "seen")
    assert all(v in extract[0] for v in json.loads(extract[1]).values())


class _RepeatBase:
    """What ChatData.repeat reads of the first stage's data: the tokenizer's tag ids."""
    class tok:
        @staticmethod
        def token_to_id(tag):
            return 100 + stage.TAGS.index(tag)


def test_a_repeat_row_marks_exactly_the_second_span_at_a_varying_distance():
    import random
    data = stage.ChatData(_RepeatBase, None, None, None, random.Random(3))
    distances = set()
    for _ in range(40):
        ids, kinds = data.repeat(129)
        assert len(ids) == len(kinds) == 129
        assert all(3 <= i < 100 for i in ids)                     # no special token, no tag
        marked = [i for i, k in enumerate(kinds) if k]
        start, end = marked[0] - 1, marked[-1] + 1               # the second span, its first token unmarked
        assert marked == list(range(start + 1, end)) and end - start >= 8
        span = ids[start:end]
        first = next(i for i in range(start) if ids[i:i + len(span)] == span)
        distances.add(start - first)
    # a fixed distance lets a head learn the distance instead of looking the token up
    assert len(distances) > 20


def test_fresh_layers_leave_the_grown_model_computing_what_it_did():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(config).eval()
    ids = torch.randint(0, 64, (1, 12))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    old = list(model.model.layers)
    stage.grow_depth(model, 5)
    layers = list(model.model.layers)
    assert len(layers) == 5 and layers[0::2] == old and model.config.num_hidden_layers == 5
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, before, atol=1e-5)
        # fresh: the new layer's attention is not its neighbour's (a copy would relearn the same patterns)
        assert not torch.equal(layers[1].self_attn.q_proj.weight, layers[0].self_attn.q_proj.weight)
    assert [layer.self_attn.layer_idx for layer in layers] == [0, 1, 2, 3, 4]


def test_the_start_span_is_the_answers_first_character_after_any_thought():
    prompt = "<|im_start|>assistant\n"
    plain = prompt + "<tool_call>\n{...}"
    assert stage.start_span(plain, len(prompt)) == (len(prompt), len(prompt) + 1, "start")
    thought = prompt + "<think>\nI will call it.\n</think>\n\n<tool_call>"
    at = thought.index("<tool_call>")
    assert stage.start_span(thought, len(prompt)) == (at, at + 1, "start")
    spans = [stage.start_span(plain, len(prompt)), (len(prompt) + 3, len(prompt) + 5, "value"),
             (len(prompt), len(plain), "ans")]
    assert stage.reply_at(spans) == len(prompt)


def test_the_shipped_log_keeps_every_checkpoint_line_and_a_loss_line_every_few_hundred_steps():
    lines = [f"12:00:00 chat step {s:5d}  {s / 100:5.1f} min  T= 512  lm_loss 1.0\n" for s in range(10, 1010, 10)]
    lines.insert(50, "12:00:00 chat step   500 call parts right (teacher-forced), held-out: first 0.50\n")
    thinned = stage.thin_log("".join(lines)).splitlines()
    assert [int(line.split()[3]) for line in thinned if " min " in line] == \
        [s for s in range(10, 1010, 10) if s % stage.LOG_EVERY == 0]
    assert any("call parts right" in line for line in thinned)


def demo_tokenizer_and_tools():
    """The shipped demo model's tokenizer and the tool task, as the stage's measures take them."""
    from appliance.engine.tokenizer import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import demo_tools_task as tools

    return Tokenizer(Path(__file__).resolve().parents[1] / "appliance" / "demo_model", {2}), tools


def test_spelling_values_split_apart_after_a_quote_and_the_line_marks_the_written_value():
    import random

    tok, tools = demo_tokenizer_and_tools()
    data = stage.ChatData.__new__(stage.ChatData)
    data.chat_tok, data.tools, data.rng = tok, tools, random.Random(0)

    def pieces(lead, value):
        return stage.value_pieces(tok, lead, value)
    values = [data.split_apart_value() for _ in range(20)]
    assert sum(pieces(" ", v) != pieces('"', v) for v in values) >= 18      # a draw may give up after 20 tries
    assert pieces(" ", "goulash") != pieces('"', "goulash") and pieces(" ", "Paris") == pieces('"', "Paris")
    text, spans = stage.spelling_line("Spell", "goulash", "dish")
    assert text == 'Spell goulash: {"dish": "goulash"}'
    assert [text[a:b] for a, b, _ in spans] == ['goulash"'] and spans[0][2] == "value"


def test_round_trip_share_reads_the_result_the_template_rendered(monkeypatch):
    """The measure renders each round trip through the chat template and counts the answers that
    give the result. A stand-in model answers with the number it finds in the last tool response
    when that response's key is `celsius` (6 of the 30 cases) and echoes the value otherwise."""
    import json
    import re

    tok, tools = demo_tokenizer_and_tools()

    def answer(model, chat_tok, prompt_ids, max_new_tokens):
        prompt = chat_tok.decode(prompt_ids)
        assert prompt.endswith("</tool_response>\nassistant\n<think>\n\n</think>\n\n")   # thinking off
        body = json.loads(re.findall(r"<tool_response>\n(.*?)\n</tool_response>", prompt, re.S)[-1])
        return f"It is {body['celsius']}." if "celsius" in body else "It is as asked."
    monkeypatch.setattr(stage, "generate", answer)
    assert stage.round_trip_share(None, tok, tools) == pytest.approx(6 / 30)
