"""Tiny random Qwen3 checkpoints that chat as Qwen3 does: its hybrid-thinking template with tools
(tests/fixtures/qwen3/chat_template.jinja) and its tags as added tokens that decode as text
(`<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`, `</tool_response>`,
"special": false as in Qwen3's tokenizer_config.json).
"""
from __future__ import annotations

import json
from pathlib import Path

from tiny_models import CORPUS, SPECIAL, build_qwen3

QWEN3_TEMPLATE = (Path(__file__).parent / "fixtures" / "qwen3" / "chat_template.jinja").read_text()
TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]
EXTRA_CORPUS = [
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    "The temperature of the big core cluster is 48.5 degrees.",
] * 20


def build_qwen3_chat(out: Path, seed: int = 0, **shape) -> Path:
    """A random Qwen3ForCausalLM whose tokenizer has Qwen3's tags and chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS + EXTRA_CORPUS, trainers.BpeTrainer(
        vocab_size=512, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
    vocab = tok.get_vocab_size()
    # the model's vocabulary is padded past the tokenizer's, as Qwen3's (151936 > 151669)
    build_qwen3(out, seed=seed, vocab_pad=vocab + 8, **shape)
    tok.save(str(out / "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": t in SPECIAL}
             for t in SPECIAL + TAGS}
    (out / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": added, "chat_template": QWEN3_TEMPLATE, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "bos_token": None, "model_max_length": 32768,
        "tokenizer_class": "Qwen2Tokenizer", "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}))
    return out
