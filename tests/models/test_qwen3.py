"""Qwen3 dense against transformers: every logit of every position.

f32 weights + f32 KV must match transformers to 1e-4 relative. Quantized modes
are held to an exact torch simulation of the same quantization (see
test_q8_agreement) because on random checkpoints the logits nearly tie.
"""
from __future__ import annotations

import pytest

from appliance import Engine
from family_checks import (TEXT, check_batched_decode_equals_single, check_decode_matches_full_pass,
                           check_f32_logits)

SHAPES = {
    "gqa2_hd32_untied": dict(heads=4, kv_heads=2, head_dim=32),
    "gqa1_hd64_tied": dict(heads=2, kv_heads=2, head_dim=64, tied=True),
    "gqa4_hd128": dict(hidden=128, heads=8, kv_heads=2, head_dim=128, intermediate=256),
    "bf16_sharded": dict(dtype="bfloat16", max_shard_size="100KB", seed=3),
}


@pytest.mark.parametrize("name", SHAPES)
def test_f32_logits_match_transformers(model_factory, name):
    check_f32_logits(model_factory(name, **SHAPES[name]), TEXT * 3)


def test_f32_logits_across_prefill_chunks(tiny_qwen3_dir):
    """Chunked prefill (chunks of 7 positions) sees the same cache as one pass."""
    check_f32_logits(tiny_qwen3_dir, TEXT * 3, prefill_chunk=7)


def test_decode_steps_match_full_pass(tiny_qwen3_dir):
    check_decode_matches_full_pass(tiny_qwen3_dir)


def test_batched_decode_equals_single(tiny_qwen3_dir):
    check_batched_decode_equals_single(Engine.load(tiny_qwen3_dir, weights="q8", kv="q8", progress=False))
