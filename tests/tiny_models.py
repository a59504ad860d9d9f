"""Tiny Qwen checkpoints with random weights, saved exactly as Hugging Face ships real ones.

A byte-level BPE tokenizer is trained on a little English so that prompts encode
to realistic ids; the chat template is ChatML, as Qwen's.
"""
from __future__ import annotations

import json
from pathlib import Path

CHATML = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Edge boards run language models on their CPUs with int8 kernels.",
    "Once upon a time there was a little board that computed attention quickly.",
    "Python is a programming language that lets you work quickly and integrate systems.",
    "Hello world! How are you today? I am fine, thank you.",
] * 20


def write_tokenizer(out: Path, vocab_size: int = 512) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 32768, "tokenizer_class": "Qwen2Tokenizer"}))
    return tok.get_vocab_size()


def build_qwen3(out: Path, *, hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=32,
                tied=False, seed=0, dtype="float32", max_shard_size=None, vocab_pad=None) -> Path:
    """Save a random Qwen3ForCausalLM (and its tokenizer) under `out`."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab = write_tokenizer(out)
    torch.manual_seed(seed)
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      vocab_size=vocab_pad or vocab, tie_word_embeddings=tied, max_position_embeddings=4096,
                      rope_theta=1_000_000.0, eos_token_id=2, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # make norms non-trivial so a missing norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "do_sample": False}))
    return out


def reference_logits(model_dir: Path, ids: list[int]):
    """transformers' float32 logits for one sequence: float32[len(ids), vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()
