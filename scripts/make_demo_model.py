"""Build the embedded demo model (appliance/demo_model/): a tiny Qwen3 with random weights.

It exists so that `make run` shows the whole appliance working with no download.
Its tokenizer is a byte-level BPE trained on docstrings of Python's standard
library (text every machine has); the weights are random until the trained demo
model replaces them, so its output is fluent-looking noise, not language.

    python scripts/make_demo_model.py [OUT_DIR]
"""
from __future__ import annotations

import importlib
import json
import pkgutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import CHATML, SPECIAL  # noqa: E402

MODULES = ["json", "collections", "functools", "itertools", "pathlib", "argparse", "logging",
           "threading", "subprocess", "socket", "email", "http", "unittest", "textwrap", "string"]


def stdlib_text() -> list[str]:
    texts = []
    for name in MODULES:
        mod = importlib.import_module(name)
        for _, sub, _ in pkgutil.walk_packages(getattr(mod, "__path__", []), name + "."):
            if sub.endswith("__main__") or ".test" in sub:
                continue  # importing these runs programs
            try:
                texts.append(importlib.import_module(sub).__doc__ or "")
            except Exception:
                pass
        texts.append(mod.__doc__ or "")
        for attr in vars(mod).values():
            doc = getattr(attr, "__doc__", None)
            if isinstance(doc, str):
                texts.append(doc)
    return [t for t in texts if t.strip()]


def main(out: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(stdlib_text(), trainers.BpeTrainer(
        vocab_size=2048, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "bos_token": None, "model_max_length": 8192, "tokenizer_class": "Qwen2Tokenizer"}, indent=1))
    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=tok.get_vocab_size(),
                      tie_word_embeddings=True, max_position_embeddings=8192, rope_theta=1_000_000.0,
                      eos_token_id=2, bos_token_id=None)
    Qwen3ForCausalLM(cfg).to(torch.float16).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2], "do_sample": True, "temperature": 0.7, "top_p": 0.9, "top_k": 40}, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "appliance" / "demo_model")
