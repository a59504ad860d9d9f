"""Quantized modes against an exact torch simulation of Q8_0.

The simulation fake-quantizes, in torch, every weight of every linear layer (and
the embedding) to Q8_0 and every activation row entering a linear layer to int8
per 32-block, exactly as the engine does. Top-1 agreement of the engine with
transformers must come within AGREEMENT_SLACK of the simulation's own agreement.
"""
from __future__ import annotations

import numpy as np
import pytest

from appliance import Engine
from appliance.kernels import quant

AGREEMENT_SLACK = 0.03


def simulated_q8_logits(model_dir, ids):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def fake_q8(w: torch.Tensor) -> torch.Tensor:
        qs, d = quant.quantize_q8_0(w.detach().numpy())
        return torch.from_numpy(quant.dequantize_q8_0(qs, d))

    with torch.no_grad():
        emb = model.get_input_embeddings()
        emb.weight.copy_(fake_q8(emb.weight))
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and module.weight is not emb.weight:
                module.weight.copy_(fake_q8(module.weight))

    def quantize_input(module, args):
        x = args[0]
        flat = x.reshape(-1, x.shape[-1]).numpy()
        q, d = quant.quantize_rows_q8(flat)
        deq = (q.reshape(len(flat), -1, quant.QK).astype(np.float32) * d[..., None]).reshape(flat.shape)
        return (torch.from_numpy(deq).reshape(x.shape),)

    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(quantize_input)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def test_q8_top1_agreement_within_simulation(model_factory, kv="q8"):
    from tiny_models import reference_logits
    model_dir = model_factory("agree", hidden=128, intermediate=256, heads=4, kv_heads=2, head_dim=32,
                              layers=2, seed=7)
    engine = Engine.load(model_dir, weights="q8", kv=kv, progress=False)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, engine.tokenizer.vocab_size, size=200).tolist()
    ref = reference_logits(model_dir, ids).argmax(-1)
    sim = simulated_q8_logits(model_dir, ids).argmax(-1)
    got = engine.logits(ids).argmax(-1)
    sim_agree = float((sim == ref).mean())
    got_agree = float((got == ref).mean())
    print(f"kv={kv}: simulation top-1 {sim_agree:.3f}, engine top-1 {got_agree:.3f}")
    assert got_agree >= sim_agree - AGREEMENT_SLACK


@pytest.mark.parametrize("weights,kv,min_corr", [("q4", "q8", 0.95), ("q8", "q4", 0.98), ("q8", "f32", 0.99)])
def test_other_formats_close_to_f32(tiny_qwen3_dir, weights, kv, min_corr):
    """Q4_0 weights, q4 and f32 KV: logits stay correlated with f32 (a broken nibble order would not)."""
    ids = list(range(3, 60))
    f32 = Engine.load(tiny_qwen3_dir, weights="f32", kv="f32", progress=False).logits(ids)
    got = Engine.load(tiny_qwen3_dir, weights=weights, kv=kv, progress=False).logits(ids)
    corr = np.corrcoef(f32.ravel(), got.ravel())[0, 1]
    assert corr > min_corr
