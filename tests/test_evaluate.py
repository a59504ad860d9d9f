"""`appliance eval` on the trained demo model: needle and perplexity output, retrieval quality,
and block-sparse attention with a k that covers every block being exact attention."""
from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from appliance import Engine
from appliance.engine.engine import DEMO_MODEL_DIR
from appliance.cli.evaluate import (ATTRIBUTES, DEPTHS, PLACES, THINGS, VALUES, filler_text, is_recalled, make_facts,
                                needle_cases, plant)
from appliance.engine.sampling import log_softmax

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models import SPECIAL  # noqa: E402

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3" / "chat_template.jinja").read_text()
QWEN3_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]

# The floor the demo model must meet at its trained context (1024), exact attention, q8 engine.
# The shipped model recalled 1.00 at 1024 in torch at the end of training (5 haystacks,
# appliance/demo_model/train_log.txt); the q8 engine recalls 35 of these 36 questions (0.97).
# The floor stays where the first stage's model was (0.75, 27 of 36): a model retrained for chat
# must not lose retrieval below it, and 12 questions have moved by one between x86 machines. Broken attention
# recalls nothing (k <= 2 in the README's table). DEMO_RETRIEVES = False skips this for a model
# that does not retrieve.
RECALL_FLOOR = 0.75
RECALL_SEEDS = (3, 4, 5)            # 3 x 4 haystacks x 3 depths = 36 questions
DEMO_RETRIEVES = True
PPL_CEILING = 1000


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "appliance", "eval", *args], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def exact():
    return Engine.load(None, max_context=2048, progress=False)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "manual.txt"
    path.write_text(filler_text())
    return path


def test_demo_model_is_a_small_hugging_face_qwen3():
    d = DEMO_MODEL_DIR
    config = json.loads((d / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"]
    assert all(config[k] % 32 == 0 for k in ("hidden_size", "intermediate_size", "head_dim"))
    # Qwen3's own hybrid-thinking template with tools, and Qwen3's tags as added tokens
    assert json.loads((d / "tokenizer_config.json").read_text())["chat_template"] == QWEN3_TEMPLATE
    vocab = json.loads((d / "tokenizer.json").read_text())
    assert [t["content"] for t in vocab["added_tokens"]] == SPECIAL + QWEN3_TAGS
    assert (d / "generation_config.json").exists()
    assert (d / "model.safetensors").stat().st_size < 16 * 2**20


def test_transformers_tokenizes_the_demo_model_as_the_engine_does():
    """The ids the model was trained on: transformers must not swap in another split pattern."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    ours = Engine.load(None, max_context=512, progress=False).tokenizer
    messages = [{"role": "user", "content": "Quote it.\n\nThe step budget, 512 tokens.\n\n  Done."}]
    text = ours.apply_chat_template(messages, enable_thinking=False)
    assert text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                          enable_thinking=False)
    assert hf(text)["input_ids"] == ours.encode(text)


def test_planted_facts_sit_at_their_depths():
    facts = make_facts(random.Random(0), 3)
    filler = "Some filler sentence here. " * 200
    text = plant(filler, facts, DEPTHS)
    where = [text.index(f["fact"]) / len(text) for f in facts]
    assert where == sorted(where) and all(abs(w - d) < 0.05 for w, d in zip(where, DEPTHS))
    assert len({f["answer"] for f in facts}) == 3


def test_facts_name_distinct_things_and_values():
    for seed in range(20):
        facts = make_facts(random.Random(seed), 6)
        things = [f["question"].rstrip("?").split()[-1] for f in facts]
        assert len(set(things)) == 6 and len({f["answer"] for f in facts}) == 6
        assert all(f["fact"].endswith(f" is {f['answer']}.") and f["answer"] in VALUES for f in facts)
    assert not set(VALUES) & set(PLACES + THINGS + " ".join(ATTRIBUTES).split())
    with pytest.raises(ValueError):
        make_facts(random.Random(0), len(THINGS) + 1)


def test_recall_is_the_first_value_word_of_the_reply():
    assert is_recalled("The password for the north gate is falcon.", "falcon")
    assert is_recalled("Falcon", "falcon")
    assert not is_recalled("The password is falconry.", "falcon")
    assert not is_recalled("The password is", "falcon")
    assert not is_recalled("It is otter, not falcon.", "falcon")


def test_needle_cases_fit_their_context(exact):
    cases = needle_cases(exact.tokenizer, 512, trials=2)
    assert len(cases) == 2 * len(DEPTHS)
    assert all(480 <= len(c["ids"]) and len(c["ids"]) + c["max_tokens"] <= 512 for c in cases)


@pytest.mark.skipif(not DEMO_RETRIEVES, reason="the shipped demo model does not retrieve yet")
def test_exact_attention_retrieves_at_the_trained_context(exact):
    cases = [c for seed in RECALL_SEEDS for c in needle_cases(exact.tokenizer, 1024, trials=4, seed=seed)]
    hits = [is_recalled(exact.generate(c["ids"], stream=False, temperature=0.0,
                                       max_tokens=c["max_tokens"])["text"], c["answer"]) for c in cases]
    assert sum(hits) / len(hits) >= RECALL_FLOOR


@pytest.mark.slow
@pytest.mark.skipif(not DEMO_RETRIEVES, reason="the shipped demo model does not retrieve yet")
def test_sparse_k32_recalls_what_exact_recalls_at_the_trained_context():
    """The long-context issue's quality check: at 2048 tokens (64 blocks, so k=32 really drops
    half of them) the default block-sparse attention recalls at least what exact attention does.
    The engine is deterministic, so this is a fixed 12-question sample, not a statistical test."""
    exact = Engine.load(None, max_context=2048, progress=False)           # cases hold their replies
    sparse = Engine.load(None, max_context=2048, sparse={"k": 32}, progress=False)
    cases = needle_cases(exact.tokenizer, 2048, trials=4, seed=0)

    def recall(engine):
        return sum(is_recalled(engine.generate(c["ids"], stream=False, temperature=0.0,
                                               max_tokens=c["max_tokens"])["text"], c["answer"])
                   for c in cases) / len(cases)

    exact_recall = recall(exact)
    assert exact_recall >= 0.6
    assert recall(sparse) >= exact_recall


def test_sparse_covering_every_block_is_exact(exact):
    sparse = Engine.load(None, max_context=2048, sparse={"k": 64, "block": 32, "probe": 8}, progress=False)
    case = needle_cases(exact.tokenizer, 1024, trials=1, seed=5)[0]
    a = exact.generate(case["ids"], stream=False, temperature=0.0, max_tokens=case["max_tokens"])
    b = sparse.generate(case["ids"], stream=False, temperature=0.0, max_tokens=case["max_tokens"])
    assert a["token_ids"] == b["token_ids"]
    ids = case["ids"][:300]
    assert exact.score(ids, 200) == sparse.score(ids, 200)


def test_score_agrees_with_a_full_forward_pass():
    engine = Engine.load(None, weights="f32", kv="f32", progress=False)
    ids = engine.tokenizer.encode(filler_text()[:2000])[:160]
    scored = engine.score(ids, 100)
    full = np.stack([log_softmax(row) for row in engine.logits(ids)])
    expected = [full[p - 1, ids[p]] for p in range(100, 160)]
    np.testing.assert_allclose(scored, expected, atol=1e-3)
    with pytest.raises(ValueError):
        engine.score(ids, 0)


def test_needle_command_table_and_json():
    r = run("needle", "--context", "256,512", "--trials", "1", "--sparse-k", "1,64")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("needle recall: 3 questions per context")
    assert lines[1].split() == ["context", "exact", "k=1", "k=64"]
    assert [line.split()[0] for line in lines[2:]] == ["256", "512"]
    r = run("needle", "--context", "512", "--trials", "1", "--sparse-k", "64", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [(row["attention"], row["k"]) for row in rows] == [("exact", None), ("sparse", 64)]
    assert rows[0]["recall"] == rows[1]["recall"] and set(rows[0]["by_depth"]) == {"0.1", "0.5", "0.9"}


def test_ppl_command_exact_and_sparse(text_file):
    args = ("ppl", "--file", str(text_file), "--context", "256", "--prefix", "128", "--windows", "1")
    r = run(*args, "--sparse-k", "1,64")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "128 tokens scored" in lines[0]
    assert [line.split()[:2] for line in lines[2:]] == [["exact", "-"], ["sparse", "1"], ["sparse", "64"]]
    r = run(*args, "--sparse-k", "64", "--json")
    rows = json.loads(r.stdout)["rows"]
    assert rows[0]["ppl"] == rows[1]["ppl"]
    # A trained model on unseen manual text: far better than uniform over the 3072-token vocabulary.
    assert 1 < rows[0]["ppl"] < PPL_CEILING


@pytest.mark.parametrize("args,needle", [
    (("ppl", "--file", "/nonexistent.txt"), "No such file"),
    (("ppl", "--file", "/dev/null", "--context", "64", "--prefix", "64"), "must be shorter"),
    (("needle", "--context", "256,x"), "comma-separated"),
    (("needle", "--sparse-k", "0"), "positive"),
])
def test_bad_input_gives_one_line_error(args, needle):
    r = run(*args)
    assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr
