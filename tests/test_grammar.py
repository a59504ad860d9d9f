"""Grammar-constrained decoding in the engine: masked tokens are never sampled, a batch mixing
constrained and free sequences leaves the free ones as they are, the grammar waits for a thought
to end, schemas llguidance cannot enforce are refused."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import jsonschema
import numpy as np
import pytest

from appliance import Engine
from appliance.engine import grammar
from appliance.engine.sampling import Sampler, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models_chat import build_qwen3_chat  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer", "minimum": 0,
                                                                             "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}}}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.load(build_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat_grammar")), weights="f32", kv="f32",
                       progress=False)


def allowed_set(matcher, vocab: int) -> set[int]:
    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[:vocab]
    return set(np.nonzero(bits)[0].tolist())


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_sampler_never_picks_a_masked_token(engine, temperature):
    """Random logits that favour masked tokens: every token drawn is one a second, independent
    matcher allows at that point, and the text is JSON valid against the schema."""
    import llguidance

    tok = engine.tokenizer
    g = grammar.json_schema(SCHEMA, tok)
    witness = llguidance.LLMatcher(grammar.bridge(tok), g.source, log_level=0)
    sampler = Sampler(SamplingParams(temperature=temperature, seed=3, grammar=g), [], tok)
    rng = np.random.default_rng(5)
    out = []
    for _ in range(200):
        allowed = allowed_set(witness, tok.vocab_size)
        logits = rng.normal(size=engine.config.vocab_size).astype(np.float32) * 3
        token = sampler(logits)
        assert token in allowed, (token, tok.decode(out))
        if token in tok.eos_token_ids:
            break
        assert witness.consume_token(token)
        out.append(token)
    else:
        pytest.fail("the grammar never let the sequence end")
    jsonschema.validate(json.loads(tok.decode(out)), SCHEMA)


def run_batch(engine, params_list, prompt):
    seqs = [engine.start(prompt, p) for p in params_list]
    outs = [[] for _ in seqs]
    try:
        for i, s in enumerate(seqs):
            outs[i].append(engine.prefill(s).token_id)
        while not all(s.done for s in seqs):
            live = [s for s in seqs if not s.done]
            for s, ev in zip(live, engine.decode(seqs)):
                outs[seqs.index(s)].append(ev.token_id)
    finally:
        for s in seqs:
            engine.release(s)
    return outs


def test_free_neighbours_are_untouched_by_a_constrained_one(engine):
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(max_tokens=80, temperature=0.0, grammar=grammar.json_schema(SCHEMA, engine.tokenizer))
    alone = run_batch(engine, [free], prompt)[0]
    mixed = run_batch(engine, [free, constrained, free], prompt)
    assert mixed[0] == alone and mixed[2] == alone
    text = engine.tokenizer.decode(mixed[1])
    jsonschema.validate(json.loads(text), SCHEMA)
    assert mixed[1] != alone


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_generated_text_matches(engine, temperature):
    prompt = engine.tokenizer.encode("Hello world!")
    for seed in range(3):
        cases = [(grammar.regex(r"[a-z]{2,6}-[0-9]{3}", engine.tokenizer), r"[a-z]{2,6}-[0-9]{3}"),
                 (grammar.choice(["yes", "no", "maybe"], engine.tokenizer), "yes|no|maybe")]
        for g, pattern in cases:
            out = engine.generate(prompt, stream=False, max_tokens=20, temperature=temperature, seed=seed, grammar=g)
            import re
            assert re.fullmatch(pattern, out["text"]), out["text"]
            assert out["finish_reason"] == "stop"


def test_the_grammar_waits_for_the_thought(engine):
    """A thought the model is made to open (and to fill with the tag itself) is free; the budget
    closes it; then the answer is held to the schema."""
    tok = engine.tokenizer
    start, end = tok.think_token_ids
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hi"}]))
    out = engine.generate(prompt, stream=False, max_tokens=60, temperature=0.0, thinking="allowed",
                          max_thinking_tokens=3, logit_bias={start: 100.0},
                          grammar=grammar.json_schema(SCHEMA, tok))
    ids = out["token_ids"]
    assert ids[:4] == [start] * 4 and end in ids
    answer = tok.decode(ids[ids.index(end) + 1:])
    jsonschema.validate(json.loads(answer), SCHEMA)


def test_tool_call_grammar_required(engine):
    tok = engine.tokenizer
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
               "additionalProperties": False}
    g = grammar.tool_calls([("get_weather", weather), ("ping", {"type": "object", "properties": {},
                                                                "additionalProperties": False})],
                           "required", False, tok)
    for seed in range(3):
        out = engine.generate(tok.encode("Hello"), stream=False, max_tokens=60, temperature=1.0, seed=seed, grammar=g)
        text = out["text"]
        assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
        call = json.loads(text[len("<tool_call>\n"):-len("\n</tool_call>")])
        assert call["name"] in ("get_weather", "ping")
        jsonschema.validate(call["arguments"], weather if call["name"] == "get_weather" else {"maxProperties": 0})


@pytest.mark.parametrize("schema, words", [
    ({"type": "nonsense"}, "type"),
    ({"type": "string", "pattern": "(?=lookahead)"}, "look-around"),
    ({"type": "string", "format": "no-such-format"}, "format"),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames"),
    ({"type": "integer", "minimum": "zero"}, "minimum"),
    ([1, 2], "object"),
])
def test_schemas_that_cannot_be_enforced_are_refused(engine, schema, words):
    with pytest.raises(grammar.GrammarError, match=words):
        grammar.json_schema(schema, engine.tokenizer)


def test_the_token_bridge_is_built_once(engine):
    assert grammar.bridge(engine.tokenizer) is grammar.bridge(engine.tokenizer)
