"""A Qwen3-0.6B-shaped checkpoint with random weights, laid out exactly like the real one.

The cost of a token does not depend on what the weights are, so speed work uses this
stand-in: transformers' Qwen3ForCausalLM with Qwen3-0.6B's config, initialised under
torch.manual_seed(0) (normal, std = initializer_range = 0.02), saved in bfloat16 with
Qwen's real tokenizer (bench/qwen_tokenizer.py) and Qwen3's generation_config.json.

    python -m bench.checkpoint OUT_DIR
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

QWEN3_0_6B = dict(
    hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
    num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
    max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6, hidden_act="silu",
    attention_bias=False, bos_token_id=151643, eos_token_id=151645, initializer_range=0.02,
)
# A 2-layer, 64-wide checkpoint of the same family, built in seconds: the benchmarks' --shape tiny
# (a check that a script runs, not a measurement).
TINY = dict(QWEN3_0_6B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32)
SHAPES = {"0.6b": QWEN3_0_6B, "tiny": TINY}
SEED = 0
MARKER = ".bench-checkpoint.json"   # written last: its presence means the directory is complete


def shape_dir(workdir, shape: str) -> Path:
    """Where the checkpoint of SHAPES[shape] is built under a benchmark's workdir."""
    return Path(workdir) / ("qwen3-0.6b-random" if shape == "0.6b" else "qwen3-tiny-random")


def recipe_key(shape: dict = QWEN3_0_6B, seed: int = SEED) -> str:
    # "v" counts changes of this recipe (2: Qwen's one-merge-per-token tokenizer.json)
    blob = json.dumps({"shape": shape, "seed": seed, "dtype": "bfloat16", "v": 2}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def is_built(out_dir, shape: dict = QWEN3_0_6B, seed: int = SEED) -> bool:
    marker = Path(out_dir) / MARKER
    try:
        return json.loads(marker.read_text()).get("key") == recipe_key(shape, seed)
    except (OSError, ValueError):
        return False


def build_checkpoint(out_dir, shape: dict = QWEN3_0_6B, seed: int = SEED, tiktoken_path=None,
                     cache_dir=None, log=print) -> Path:
    """Build (or reuse, if already complete) the random checkpoint in out_dir."""
    out = Path(out_dir)
    if is_built(out, shape, seed):
        return out
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from bench.qwen_tokenizer import write_qwen_tokenizer

    t0 = time.perf_counter()
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = Qwen3Config(**shape)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)   # transformers' init: normal(0, 0.02), norms at 1
    model = model.to(torch.bfloat16)
    model.config.architectures = ["Qwen3ForCausalLM"]
    n_params = sum(p.numel() for p in model.parameters())
    log(f"  random Qwen3 ({n_params / 1e6:.0f} M parameters) initialised in {time.perf_counter() - t0:.0f} s")
    model.save_pretrained(tmp, safe_serialization=True)
    del model
    write_qwen_tokenizer(tmp, tiktoken_path=tiktoken_path, cache_dir=cache_dir,
                         model_max_length=shape["max_position_embeddings"])
    (tmp / MARKER).write_text(json.dumps({"key": recipe_key(shape, seed), "seed": seed, "shape": shape},
                                         indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log(f"  checkpoint written to {out} in {time.perf_counter() - t0:.0f} s")
    return out


if __name__ == "__main__":
    import os
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    build_checkpoint(sys.argv[1])
