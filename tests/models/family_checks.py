"""The checks every model family passes against transformers, written once.

A family's test file builds its tiny checkpoints and calls these; a new family (dense,
MoE, vision-language, or one still to come) gets the same scrutiny by calling them too.
Imported by name (`from family_checks import ...`), like tests/tiny_models.py.
"""
from __future__ import annotations

import numpy as np

from appliance import Engine
from tiny_models import reference_logits

# Relative to the largest logit magnitude of the position (logits near 0 make a per-element
# relative error meaningless).
F32_RTOL = 1e-4
TEXT = ("Edge boards run language models on their CPUs with int8 kernels. "
        "The quick brown fox jumps over the lazy dog. Hello world! ")


def relative_error(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got - ref| per element, over the position's largest |ref|."""
    assert got.shape == ref.shape
    assert np.isfinite(got).all()
    return np.abs(got - ref) / np.abs(ref).max(axis=-1, keepdims=True)


def assert_close_logits(got: np.ndarray, ref: np.ndarray, rtol: float) -> None:
    err = relative_error(got, ref)
    position = np.unravel_index(err.argmax(), err.shape)[0]
    assert err.max() < rtol, f"max relative error {err.max():.2e} at position {position}"


def check_f32_logits(model_dir, text: str = TEXT, **load) -> Engine:
    """f32 weights and KV: every logit of every position within F32_RTOL of transformers."""
    engine = Engine.load(model_dir, weights="f32", kv="f32", progress=False, **load)
    ids = engine.tokenizer.encode(text)
    assert_close_logits(engine.logits(ids), reference_logits(model_dir, ids), F32_RTOL)
    return engine


def check_decode_matches_full_pass(model_dir, prompt: str = "Hello world! How are", n: int = 12) -> Engine:
    """Greedy decode token by token equals the argmax of transformers' full pass over the same ids."""
    engine = Engine.load(model_dir, weights="f32", kv="f32", progress=False)
    ids = engine.tokenizer.encode(prompt)
    out = engine.generate(ids, stream=False, max_tokens=n, temperature=0.0, ignore_eos=True)
    expected = reference_logits(model_dir, ids + out["token_ids"])[len(ids) - 1:-1].argmax(-1)
    assert out["token_ids"] == expected.tolist()
    return engine


def check_batched_decode_equals_single(engine: Engine, texts=("Hello world", "The quick brown fox jumps", "Python"),
                                       n: int = 8) -> None:
    """Sequences decoded together get exactly the tokens they get alone, and free every block."""
    prompts = [engine.tokenizer.encode(t) for t in texts]
    alone = [engine.generate(p, stream=False, max_tokens=n, temperature=0.0, ignore_eos=True)["token_ids"]
             for p in prompts]
    params = engine.sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
    seqs = [engine.start(p, params) for p in prompts]
    for s in seqs:
        engine.prefill(s)
    while not all(s.done for s in seqs):
        engine.decode(seqs)
    assert [s.output_ids for s in seqs] == alone
    for s in seqs:
        engine.release(s)
    assert engine.kv_blocks_used == 0
