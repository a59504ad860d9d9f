"""The trained demo model: greedy continuations with q8 weights + q8 KV agree with f32 + f32.

Random checkpoints cannot show this (their logits nearly tie, so any rounding flips the
argmax); a trained model has margins, and int8 must keep its greedy text on most prompts.
"""
from __future__ import annotations

import pytest

from appliance import Engine
from appliance.cli.evaluate import needle_cases

CHATS = ["What does json.dumps do?", "Explain os.path.join.", "Tell me about itertools.chain.",
         "What is collections.OrderedDict?", "What does re.compile do?", "Explain functools.partial.",
         "Tell me about threading.Lock.", "What is pathlib.Path?", "What does shutil.copy do?",
         "Explain subprocess.run."]
GEN = 24
# Measured on the shipped model: 23-24 of the 28 prompts are identical on x86. "Most" = at least 70% of the
# prompts give the same 24 greedy tokens; and where they part, not before the 4th token on average.
MIN_IDENTICAL = 0.7


def _continuations(engine, prompts):
    return [engine.generate(p, stream=False, temperature=0.0, max_tokens=GEN, ignore_eos=True)["token_ids"]
            for p in prompts]


@pytest.fixture(scope="module")
def prompts():
    f32 = Engine.load(None, weights="f32", kv="f32", max_context=1024, progress=False)
    chats = [f32.tokenizer.encode(f32.tokenizer.apply_chat_template([{"role": "user", "content": c}]))
             for c in CHATS]
    # 28 prompts: on 16 one rounding decides the 70% (12 of 16 on one x86 machine, 11 on another).
    needles = [c["ids"] for seed in (11, 12, 13) for c in needle_cases(f32.tokenizer, 512, trials=2, seed=seed)]
    return f32, chats + needles


def test_q8_greedy_text_agrees_with_f32(prompts):
    f32, ids = prompts
    q8 = Engine.load(None, weights="q8", kv="q8", max_context=1024, progress=False)
    want, got = _continuations(f32, ids), _continuations(q8, ids)
    identical = sum(a == b for a, b in zip(want, got)) / len(ids)
    first_split = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), GEN) for a, b in zip(want, got)]
    print(f"q8+q8 vs f32: {identical:.0%} of {len(ids)} prompts identical over {GEN} tokens; "
          f"first difference at token {first_split}")
    assert identical >= MIN_IDENTICAL, first_split
    assert sum(first_split) / len(first_split) >= 4
