"""The engine's step API and generate(): limits, stops, logprobs, KV accounting."""
from __future__ import annotations

import numpy as np
import pytest

from appliance import Engine
from appliance.errors import ContextLengthError, KVCacheFullError


@pytest.fixture(scope="module")
def engine(tiny_qwen3_dir):
    return Engine.load(tiny_qwen3_dir, weights="q8", kv="q8", max_context=256, progress=False)


def test_events_stream_text_and_finish_with_length(engine):
    events = list(engine.generate("Hello world", max_tokens=5, temperature=0.0, ignore_eos=True))
    assert len(events) == 5
    assert events[0].prefill_s is not None and events[0].prompt_tokens > 0
    assert [e.completion_tokens for e in events] == [1, 2, 3, 4, 5]
    assert events[-1].finish_reason == "length" and all(e.finish_reason is None for e in events[:-1])
    assert engine.kv_blocks_used == 0


def test_text_deltas_add_up_to_decoded_output(engine):
    out = engine.generate("The quick brown", stream=False, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert out["text"] == engine.tokenizer.decode(out["token_ids"])


def test_stop_string_ends_generation(engine):
    free = engine.generate("The quick brown", stream=False, max_tokens=12, temperature=0.0, ignore_eos=True)
    text = free["text"]
    stop = text[3:6] if len(text) >= 6 else None
    if not stop or not stop.strip():
        pytest.skip("the random model's output has no usable stop substring")
    out = engine.generate("The quick brown", stream=False, max_tokens=12, temperature=0.0, ignore_eos=True,
                          stop=[stop])
    assert out["finish_reason"] == "stop"
    assert out["text"] == text[:text.index(stop)]


def test_logprobs(engine):
    event = next(iter(engine.generate("Hello", max_tokens=1, temperature=0.0, logprobs=3)))
    assert event.logprob <= 0.0
    assert len(event.top_logprobs) == 3
    assert event.top_logprobs[0][0] == event.token_id          # greedy takes the most likely
    assert event.top_logprobs[0][2] == pytest.approx(event.logprob)


def test_prompt_longer_than_context_is_refused(engine):
    with pytest.raises(ContextLengthError) as info:
        engine.start([5] * 300, engine.sampling_params())
    assert "300" in str(info.value) and "256" in str(info.value)


def test_generation_stops_at_the_context_limit(engine):
    out = engine.generate([5] * 250, stream=False, max_tokens=100, temperature=0.0, ignore_eos=True)
    assert out["finish_reason"] == "length"
    assert out["prompt_tokens"] + out["completion_tokens"] <= 256


def test_kv_cache_full_is_an_error_not_a_crash(tiny_qwen3_dir):
    small = Engine.load(tiny_qwen3_dir, max_context=64, kv_cache_tokens=64, progress=False)
    params = small.sampling_params(max_tokens=4)
    first = small.start([5] * 60, params)
    with pytest.raises(KVCacheFullError):
        small.start([5] * 60, params)
    small.release(first)
    assert small.kv_blocks_used == 0
    small.release(small.start([5] * 60, params))


def test_empty_prompt_and_bad_token_ids(engine):
    with pytest.raises(ValueError):
        engine.start([], engine.sampling_params())
    with pytest.raises(ValueError):
        engine.start([10**7], engine.sampling_params())


def test_generation_defaults_come_from_the_checkpoint(engine):
    # tiny_models writes do_sample: false -> greedy
    assert engine.sampling_params().temperature == 0.0
    assert engine.sampling_params(temperature=0.5).temperature == 0.5


def test_chat_template_renders_chatml(engine):
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_eos_stops_with_reason_stop(engine):
    eos = next(iter(engine.tokenizer.eos_token_ids))
    seq = engine.start([5, 6, 7], engine.sampling_params(max_tokens=10))
    logits = np.zeros(engine.config.vocab_size, np.float32)
    logits[eos] = 10.0
    event = engine._accept(seq, logits, 0.0)
    assert event.finish_reason == "stop" and event.text == ""
    engine.release(seq)


def test_info_reports_kv_bytes(engine):
    info = engine.info()
    assert info["kv_bytes_per_token_per_layer"] == 2 * info["kv_heads"] * (info["head_dim"] + 4)
    assert info["threads"] >= 1 and info["weights"] == "q8"


def test_kv_full_mid_decode_leaves_sequences_consistent(tiny_qwen3_dir):
    """A decode step that cannot reserve raises before any sequence's length moves."""
    small = Engine.load(tiny_qwen3_dir, max_context=64, kv_cache_tokens=64, progress=False)
    params = small.sampling_params(max_tokens=40, temperature=0.0, ignore_eos=True)
    a, b = small.start([5] * 32, params), small.start([6] * 32, params)   # 2 blocks: the pool
    small.prefill(a)
    small.prefill(b)
    lengths = (a.n_context, b.n_context)
    with pytest.raises(KVCacheFullError):
        small.decode([a, b])
    assert (a.n_context, b.n_context) == lengths
    small.release(b)
    small.decode([a])                                   # a goes on once space is back
    assert a.n_context == lengths[0] + 1
