"""Qwen3 dense against transformers: every logit of every position.

f32 weights + f32 KV must match transformers to 1e-4 relative. Quantized modes
are held to an exact torch simulation of the same quantization (see
test_q8_agreement) because on random checkpoints the logits nearly tie.
"""
from __future__ import annotations

import numpy as np
import pytest

from appliance import Engine
from tiny_models import reference_logits

# Relative to the largest logit magnitude of the position (logits near 0 make a per-element
# relative error meaningless).
F32_RTOL = 1e-4

SHAPES = {
    "gqa2_hd32_untied": dict(heads=4, kv_heads=2, head_dim=32),
    "gqa1_hd64_tied": dict(heads=2, kv_heads=2, head_dim=64, tied=True),
    "gqa4_hd128": dict(hidden=128, heads=8, kv_heads=2, head_dim=128, intermediate=256),
    "bf16_sharded": dict(dtype="bfloat16", max_shard_size="100KB", seed=3),
}

TEXT = ("Edge boards run language models on their CPUs with int8 kernels. "
        "The quick brown fox jumps over the lazy dog. Hello world! " * 3)


def assert_close_logits(got: np.ndarray, ref: np.ndarray, rtol: float) -> None:
    assert got.shape == ref.shape
    assert np.isfinite(got).all()
    scale = np.abs(ref).max(axis=-1, keepdims=True)
    err = np.abs(got - ref) / scale
    assert err.max() < rtol, f"max relative error {err.max():.2e} at position {np.unravel_index(err.argmax(), err.shape)[0]}"


@pytest.mark.parametrize("name", SHAPES)
def test_f32_logits_match_transformers(model_factory, name):
    model_dir = model_factory(name, **SHAPES[name])
    engine = Engine.load(model_dir, weights="f32", kv="f32", progress=False)
    ids = engine.tokenizer.encode(TEXT)
    assert_close_logits(engine.logits(ids), reference_logits(model_dir, ids), F32_RTOL)


def test_f32_logits_across_prefill_chunks(tiny_qwen3_dir):
    """Chunked prefill (chunks of 7 positions) sees the same cache as one pass."""
    engine = Engine.load(tiny_qwen3_dir, weights="f32", kv="f32", progress=False, prefill_chunk=7)
    ids = engine.tokenizer.encode(TEXT)
    assert_close_logits(engine.logits(ids), reference_logits(tiny_qwen3_dir, ids), F32_RTOL)


def test_decode_steps_match_full_pass(tiny_qwen3_dir):
    """Greedy decode token by token equals the argmax of a full forward pass over the same ids."""
    engine = Engine.load(tiny_qwen3_dir, weights="f32", kv="f32", progress=False)
    prompt = engine.tokenizer.encode("Hello world! How are")
    out = engine.generate(prompt, stream=False, max_tokens=12, temperature=0.0, ignore_eos=True)
    ids = prompt + out["token_ids"]
    ref = reference_logits(tiny_qwen3_dir, ids)
    expected = ref[len(prompt) - 1:-1].argmax(-1)
    assert out["token_ids"] == expected.tolist()


def test_batched_decode_equals_single(tiny_qwen3_dir):
    """Sequences decoded together get exactly the tokens they get alone."""
    engine = Engine.load(tiny_qwen3_dir, weights="q8", kv="q8", progress=False)
    prompts = [engine.tokenizer.encode(t) for t in ("Hello world", "The quick brown fox jumps", "Python")]
    alone = [engine.generate(p, stream=False, max_tokens=8, temperature=0.0, ignore_eos=True)["token_ids"]
             for p in prompts]
    params = engine.sampling_params(max_tokens=8, temperature=0.0, ignore_eos=True)
    seqs = [engine.start(p, params) for p in prompts]
    for s in seqs:
        engine.prefill(s)
    while not all(s.done for s in seqs):
        engine.decode(seqs)
    assert [s.output_ids for s in seqs] == alone
    for s in seqs:
        engine.release(s)
    assert engine.kv_blocks_used == 0
