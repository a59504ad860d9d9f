"""Per-sequence logit processing against numpy twins of its arithmetic, and in the engine's
batched step: penalties, logit_bias, min_tokens, stop_token_ids, the thinking budget."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from appliance import Engine
from appliance.engine.sampling import Sampler, SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from tiny_models_chat import build_qwen3_chat  # noqa: E402

V = 50
rng = np.random.default_rng(7)
STEPS = [rng.normal(scale=2.0, size=V).astype(np.float32) for _ in range(40)]


def twin(logits: np.ndarray, prompt: list[int], out: list[int], p: SamplingParams) -> np.ndarray:
    """What the processors must do to one row, written out from the definitions."""
    x = logits.astype(np.float64)
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(out):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    counts = np.bincount(np.asarray(out, np.intp), minlength=V).astype(np.float64) if out else np.zeros(V)
    x -= counts * p.frequency_penalty + (counts > 0) * p.presence_penalty          # OpenAI's formula
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    return x


@pytest.mark.parametrize("params", [
    dict(presence_penalty=1.5),
    dict(frequency_penalty=0.8),
    dict(presence_penalty=-0.5, frequency_penalty=1.2),
    dict(repetition_penalty=1.3, presence_penalty=0.7, frequency_penalty=0.4),
    dict(logit_bias={3: 5.0, 7: -2.5, 11: 1.5}),
    dict(frequency_penalty=2.0, logit_bias={k: float(k % 7 - 3) for k in range(0, V, 2)}),
])
def test_greedy_tokens_follow_the_twin(params):
    p = SamplingParams(temperature=0.0, **params)
    prompt = [1, 2, 3, 3, 9]
    sampler = Sampler(p, prompt)
    out = []
    for logits in STEPS:
        want = int(np.argmax(twin(logits, prompt, out, p)))
        got = sampler(logits)
        assert got == want
        out.append(got)
    assert len(set(out)) > 1


def test_processors_edit_only_a_copy_and_match_the_twin_numerically():
    p = SamplingParams(temperature=0.0, presence_penalty=0.9, frequency_penalty=0.3, logit_bias={4: 2.0})
    sampler = Sampler(p, [])
    out = []
    for logits in STEPS[:10]:
        before = logits.copy()
        x = logits.astype(np.float32, copy=True)
        for proc in sampler.processors:
            proc.apply(x)
        np.testing.assert_allclose(x, twin(logits, [], out, p), rtol=1e-6, atol=1e-5)
        token = sampler(logits)
        np.testing.assert_array_equal(logits, before)
        out.append(token)


def test_minus_100_bans_a_token_even_when_sampling():
    best = [int(np.argmax(l)) for l in STEPS]
    sampler = Sampler(SamplingParams(temperature=1.0, seed=0, logit_bias={t: -100.0 for t in set(best)}), [])
    assert not set(best) & {sampler(l) for l in STEPS for _ in range(5)}


def test_plus_100_selects_a_token():
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1, logit_bias={17: 100.0}), [])
    assert {sampler(l) for l in STEPS} == {17}


class FakeTokenizer:
    """Token i is chr(97 + i) for i < 40; 40 = <think>, 41 = </think>, 42 = "\\n", 43 = "\\n\\n", 49 = EOS."""
    eos_token_ids = {49}
    think_token_ids = (40, 41)
    TEXT = {40: "<think>", 41: "</think>", 42: "\n", 43: "\n\n", 49: ""}

    def encode(self, text):
        return {"\n": [42], "\n\n": [43]}[text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.TEXT.get(i, chr(97 + i)) for i in ids)


def test_min_tokens_bans_eos_and_stop_ids_until_reached():
    loves_eos = np.zeros(V, np.float32)
    loves_eos[49], loves_eos[5], loves_eos[6] = 10.0, 9.0, 1.0
    sampler = Sampler(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]), [], FakeTokenizer())
    assert [sampler(loves_eos) for _ in range(4)] == [6, 6, 6, 49]


def test_thinking_budget_forces_the_close_of_the_thought():
    logits = np.zeros(V, np.float32)
    logits[7] = 5.0                                  # the model would think "h" forever
    sampler = Sampler(SamplingParams(temperature=0.0, max_thinking_tokens=3, thinking="open"), [], FakeTokenizer())
    assert [sampler(logits) for _ in range(8)] == [7, 7, 7, 42, 41, 43, 7, 7]


def test_thinking_budget_after_a_newline_and_when_the_model_opens_the_thought():
    rows = [np.eye(V, dtype=np.float32)[t] * 5 for t in (40, 42, 42, 42, 42, 42, 3)]
    sampler = Sampler(SamplingParams(temperature=0.0, max_thinking_tokens=2, thinking="allowed"), [],
                      FakeTokenizer())
    # <think>, two thought tokens ending a line, then no second newline before </think>
    assert [sampler(r) for r in rows] == [40, 42, 42, 41, 43, 42, 3]


def test_thought_closed_by_the_model_is_not_forced():
    think_then_close = [np.eye(V, dtype=np.float32)[t] * 5 for t in (40, 1, 41, 2, 2, 2)]
    sampler = Sampler(SamplingParams(temperature=0.0, max_thinking_tokens=4, thinking="allowed"), [],
                      FakeTokenizer())
    assert [sampler(l) for l in think_then_close] == [40, 1, 41, 2, 2, 2]


def test_sequences_without_processing_carry_none():
    assert Sampler(SamplingParams(), [1, 2], FakeTokenizer()).processors == ()
    assert Sampler(SamplingParams(max_thinking_tokens=5), [1, 2], FakeTokenizer()).processors == ()


@pytest.mark.parametrize("bad", [dict(presence_penalty=2.5), dict(frequency_penalty=-3),
                                 dict(logit_bias={1: 101.0}), dict(logit_bias={-1: 1.0}),
                                 dict(min_tokens=-1), dict(min_tokens=20, max_tokens=10),
                                 dict(stop_token_ids=[-2]), dict(max_thinking_tokens=-1), dict(thinking="maybe")])
def test_invalid_processing_params_rejected(bad):
    with pytest.raises(ValueError):
        SamplingParams(**bad)


# ---- in the engine's batched step ----------------------------------------------------------------

@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return Engine.load(build_qwen3_chat(tmp_path_factory.mktemp("qwen3_chat_logits")), weights="f32", kv="f32",
                       progress=False)


def generate(engine, ids, **kw):
    return engine.generate(ids, stream=False, temperature=0.0, ignore_eos=True, **kw)


def test_stop_token_ids_end_with_stop_and_min_tokens_holds_them(engine):
    ids = engine.tokenizer.encode("Hello world! How are you today?")
    free = generate(engine, ids, max_tokens=12)["token_ids"]
    stop = free[2]
    first = free.index(stop)
    out = generate(engine, ids, max_tokens=12, stop_token_ids=[stop])
    assert out["finish_reason"] == "stop" and out["token_ids"] == free[:first + 1]
    assert engine.tokenizer.decode([stop]) not in out["text"][len(engine.tokenizer.decode(free[:first])):]
    held = generate(engine, ids, max_tokens=12, stop_token_ids=[stop], min_tokens=first + 3)
    assert len(held["token_ids"]) >= first + 3 and stop not in held["token_ids"][:first + 3]


def test_penalties_in_a_batch_leave_the_neighbours_alone(engine):
    """Two sequences decode together; one has penalties and a 50-entry logit_bias. The other gets
    the tokens it gets alone, and the first gets the tokens the twin predicts."""
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    plain = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    alone = generate(engine, ids, max_tokens=10)["token_ids"]
    bias = {t: (-5.0 if t % 2 else 3.0) for t in range(60, 110)}
    busy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=1.0,
                          frequency_penalty=0.5, logit_bias=bias)
    a, b = engine.start(ids, plain), engine.start(ids, busy)
    try:
        firsts = [engine.prefill(a).token_id, engine.prefill(b).token_id]
        outs = [[firsts[0]], [firsts[1]]]
        while not (a.done and b.done):
            for seq, ev in zip([s for s in (a, b) if not s.done], engine.decode([a, b])):
                outs[(a, b).index(seq)].append(ev.token_id)
    finally:
        engine.release(a)
        engine.release(b)
    assert outs[0] == alone
    # the penalised sequence against the twin, step by step over the model's own logits
    seen = []
    for step, token in enumerate(outs[1]):
        row = engine.logits(ids + seen)[-1]
        assert token == int(np.argmax(twin_full(row, seen, busy))), step
        seen.append(token)


def twin_full(row, out, p):
    x = row.astype(np.float64)
    counts = np.bincount(np.asarray(out, np.intp), minlength=x.size) if out else np.zeros(x.size)
    x -= counts * p.frequency_penalty + (counts > 0) * p.presence_penalty
    for t, b in p.logit_bias.items():
        x[t] += b
    return x


def test_thinking_budget_in_the_engine(engine):
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Hello!"}]) + "<think>\n")
    out = generate(engine, prompt, max_tokens=12, max_thinking_tokens=4, thinking="open")["token_ids"]
    start, end = tok.think_token_ids
    assert end in out
    close = out.index(end)
    assert close in (4, 5)                                       # 4 thought tokens, a newline unless one ended
    assert out[close + 1:close + 1 + len(tok.encode("\n\n"))] == tok.encode("\n\n")
    assert tok.decode(out[:close]).endswith("\n")
