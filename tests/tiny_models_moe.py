"""Tiny random Qwen3-MoE checkpoints, saved by transformers exactly as Qwen3-30B-A3B ships
(per-expert `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.gate.weight` router)."""
from __future__ import annotations

import json
from pathlib import Path

from tiny_models import write_tokenizer


def build_qwen3_moe(out: Path, *, hidden=64, intermediate=128, moe_intermediate=64, layers=2, heads=4,
                    kv_heads=2, head_dim=32, experts=8, top_k=2, norm_topk_prob=True, mlp_only_layers=(1,),
                    decoder_sparse_step=1, seed=0, dtype="float32", max_shard_size=None,
                    weight_std=0.1, router_std=0.5) -> Path:
    """Save a random Qwen3MoeForCausalLM (and its tokenizer) under `out`.

    Weights are drawn larger than transformers' init (std 0.02) so that the experts'
    outputs and the routing weights move the logits well beyond the f32 tolerance: a
    wrong renormalization or a wrong expert would show. The router is sharper still,
    so that top-k choices are not near ties.
    """
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    vocab = write_tokenizer(out)
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(hidden_size=hidden, intermediate_size=intermediate, moe_intermediate_size=moe_intermediate,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, vocab_size=vocab, num_experts=experts, num_experts_per_tok=top_k,
                         norm_topk_prob=norm_topk_prob, mlp_only_layers=list(mlp_only_layers),
                         decoder_sparse_step=decoder_sparse_step, max_position_embeddings=4096,
                         rope_theta=1_000_000.0, tie_word_embeddings=False, eos_token_id=2, bos_token_id=None)
    model = Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:           # non-trivial norms, so a missing norm would show
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, router_std)
            else:
                p.normal_(0.0, weight_std)
    model = model.to(getattr(torch, dtype))
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [2], "do_sample": False}))
    return out
